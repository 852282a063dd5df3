"""Prompt token ids as the pod will see them: the chat template rendered and tokenized with the model's tokenizer.

Mirrors the runtime's rules (``runtime/server.py``): completions take a string (tokenized without adding special
tokens) or token ids, and a one-element batch; chat renders ``messages`` (text parts joined) with ``add_generation_prompt``.
The tokenizer is loaded with ``transformers.PreTrainedTokenizerFast`` (``AutoTokenizer`` imports torch in
transformers 5; this class does not), so the router stays torch-free. The default model's directory is resolved by ``pdserve.runtime.model_loader`` in a short-lived
subprocess, because that module imports torch.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

from pdserve.runtime.block_hash import hash_token_blocks

log = logging.getLogger(__name__)


def default_tokenizer_path(timeout: float = 600.0) -> str | None:
    """The default model's local directory (converted once and cached by the model loader), or None if unavailable."""
    code = ("from pdserve.runtime.model_loader import resolve_model_path; print(resolve_model_path(None))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot resolve the default model directory: %s", e)
        return None
    if out.returncode != 0:
        log.warning("cannot resolve the default model directory: %s", out.stderr.strip()[-500:])
        return None
    return out.stdout.strip().splitlines()[-1]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


class PromptTokenizer:
    def __init__(self, path: str):
        from transformers import PreTrainedTokenizerFast

        self.path = path
        self.tok = PreTrainedTokenizerFast.from_pretrained(path)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Prompt token ids of an OpenAI request body, or None when the body is not something we can tokenize
        (the pod will answer it with its own error)."""
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                return None
            msgs = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in msgs]
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=body.get("add_generation_prompt", True),
                                               tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.tok.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None


def estimate_tokens(body: dict[str, Any]) -> int:
    """Rough prompt length without a tokenizer (4 characters per token, as GIE estimates)."""
    if "messages" in body and isinstance(body["messages"], list):
        chars = sum(len(_text(m.get("content"))) for m in body["messages"] if isinstance(m, dict))
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return len(p)
        chars = len(json.dumps(p)) if p is not None else 0
    return chars // 4


def block_hashes(token_ids: list[int], block_size: int, cache_salt: Any) -> list[bytes]:
    """The shared chained hashes of the prompt's full blocks (same function as the runtime's prefix cache)."""
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
    return hash_token_blocks(token_ids, block_size, salt)
