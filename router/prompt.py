"""Prompt token ids as the pod will see them: the chat template rendered and tokenized with the model's tokenizer.

Mirrors the runtime's rules (``runtime/request_mapping.py``): completions take a string (tokenized without adding
special tokens) or token ids, and a one-element batch; chat renders ``messages`` (text parts joined) with
``add_generation_prompt``. The tokenizer is loaded with ``transformers.PreTrainedTokenizerFast`` (``AutoTokenizer``
imports torch in transformers 5; this class does not), so the router stays torch-free. The default model's directory
is resolved by ``pdserve.runtime.model_loader`` in a short-lived subprocess, because that module imports torch.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from typing import Any

from pdserve.runtime.block_hash import BlockHash, hash_token_blocks
from pdserve.runtime.byte_bounded_cache import ByteBoundedCache

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
    """The text of a message's content (a string or a list of parts); anything else counts as no text (the pod judges
    the request, the router only needs an estimate)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
    return ""


# CPython sizes: a list holds an 8-byte pointer per id and most token ids (> 256) are separate 28-byte ints; a dict
# entry with its hash costs ~100 bytes. (tests/router/test_router_prompt.py measures the real total with tracemalloc.)
GIL_FREE_CHARS = 16 * 1024  # pieces at least this long are encoded with the GIL released


def _piece_cost(piece: str, ids: list[int]) -> int:
    return sys.getsizeof(piece) + 56 + 36 * len(ids) + 100


class PromptTokenizer:
    """Token ids of request bodies, fast on the hot path.

    The chat template is compiled once and rendered directly; the rendered text is split at the tokenizer's special
    tokens and each piece is encoded once and cached (HF tokenizers split at added tokens before anything else, so
    encoding the pieces separately gives exactly the ids of encoding the whole text; with many requests sharing a
    system prompt the long piece is encoded once). Tokenizers whose added tokens strip or normalize fall back to
    encoding the whole text."""

    def __init__(self, path: str, cache_bytes: int = 64 * 1024 * 1024, max_chars: int = 2 * 1024 * 1024):
        from transformers import PreTrainedTokenizerFast

        self.path, self.max_chars = path, max_chars
        self.tok = PreTrainedTokenizerFast.from_pretrained(path)
        self.fast = self.tok.backend_tokenizer
        self._pieces = ByteBoundedCache(cache_bytes, _piece_cost)
        self._template = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            if self.tok.chat_template:
                self._template = _compile_jinja_template(self.tok.chat_template)
        except Exception as e:  # noqa: BLE001 (private helper moved: fall back to apply_chat_template)
            log.debug("chat template fast path unavailable: %s", e)
        added = self.tok.added_tokens_decoder.values()
        self._special = {t.content: self.tok.convert_tokens_to_ids(t.content) for t in added}
        plain = all(not (t.lstrip or t.rstrip or t.normalized or t.single_word) for t in added)
        self._split = (re.compile("(" + "|".join(re.escape(c) for c in sorted(self._special, key=len, reverse=True))
                                  + ")") if plain and self._special else None)

    def _encode_piece(self, text: str) -> list[int]:
        if len(text) < GIL_FREE_CHARS:
            return self.fast.encode(text, add_special_tokens=False).ids
        # ``encode`` holds the GIL for the whole encoding (seconds for megabytes), starving the event loop even from
        # another thread; ``encode_batch`` releases it while it works.
        return self.fast.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False)``, piecewise and cached."""
        if self._split is None:
            return self._encode_piece(text)
        ids: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = self._special.get(piece)
            if sid is not None:
                ids.append(sid)
                continue
            cached = self._pieces.get(piece)
            if cached is None:
                cached = self._pieces.put(piece, self._encode_piece(piece))
            ids.extend(cached)
        return ids

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self._template is not None:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.tok.special_tokens_map)
        return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Prompt token ids of an OpenAI request body, or None when the body is not something we can tokenize
        (the pod will answer it with its own error) or its text is longer than ``max_chars`` (far beyond any
        context window: the pod will refuse it, and exact routing is not worth seconds of tokenizing)."""
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                return None
            msgs = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in msgs]
            if sum(len(m["content"]) for m in msgs) > self.max_chars:
                return None
            return self.encode(self.render_chat(msgs, bool(body.get("add_generation_prompt", True))))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.encode(prompt) if len(prompt) <= self.max_chars else None
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


def block_hashes(token_ids: list[int], block_size: int, cache_salt: Any,
                 lora_digest: str | None = None) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks: the runtime's own ``block_hash.hash_token_blocks`` (memoized
    there), so they equal the engine's by construction (``lora_digest``: the weight digest of the request's adapter
    on the pod, as the engine keys it)."""
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
    return hash_token_blocks(token_ids, block_size, salt, lora_digest=lora_digest)
