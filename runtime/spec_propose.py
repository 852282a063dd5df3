"""Draft proposers: after a step's tokens are appended, each running request at its decode point gets up to k draft
tokens in ``request.spec_token_ids``; the scheduler sends them as extra query tokens of the next step, where the target
model verifies them (pdserve.runtime.rejection_sampler).

- ``NgramProposer`` (prompt lookup): the longest suffix n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min``)
  that occurred earlier in prompt + output; its most recent earlier occurrence's continuation is the draft. One
  vectorized numpy pass per n over the request's tokens: O(len * n), no quadratic scan.
- ``DraftModelProposer``: a smaller model with the same tokenizer runs k steps (greedy for greedy requests; sampling
  requests draw from the draft's distribution q, kept for the min(1, p/q) acceptance rule). Its KV cache is its own tensor
  with the SAME number of blocks, addressed by the SAME block ids as the target's, so one block allocation covers both
  models (the engine sizes the pool for both). The draft catches up on the tokens it has not seen (prefill, the tokens
  accepted last step) in one chunk, then decodes k - 1 single tokens; its KV at draft positions is scratch that the
  next catch-up overwrites. Draft KV only changes proposals, never output: the target verifies every token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pdserve.runtime.rejection_sampler import request_generator
from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.sampler import _top_k_top_p_min_p
from pdserve.runtime.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.runtime.spec_config import SpeculativeConfig


def max_drafts(req: Request, k: int, max_len: int) -> int:
    """Most drafts worth verifying: the step emits at most drafts + 1 tokens, never past max_tokens or max_len."""
    return max(0, min(k, req.max_tokens - req.num_output_tokens - 1, max_len - req.num_tokens - 1))


def can_speculate(req: Request) -> bool:
    """Penalties and an active min_tokens mask depend on the tokens before each position: such requests run plainly."""
    sp = req.sampling_params
    return (req.status == RequestStatus.RUNNING and not sp.has_penalties
            and req.num_output_tokens >= sp.min_tokens and req.num_computed_tokens == req.num_tokens - 1)


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier occurrence of the longest matching suffix n-gram."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)     # (L-n, n), a view
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_len: int) -> None:
        self.config, self.max_len = config, max_len

    def propose(self, requests: Sequence[Request]) -> None:
        c = self.config
        for req in requests:
            k = max_drafts(req, c.num_speculative_tokens, self.max_len) if can_speculate(req) else 0
            req.spec_token_ids = ngram_lookup(np.asarray(req.all_token_ids, dtype=np.int64), c.prompt_lookup_min,
                                              c.prompt_lookup_max, k) if k else []


class TruncatedModel(torch.nn.Module):
    """The first ``num_layers`` decoder layers of ``model`` with its final norm and LM head, sharing its weights."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        if num_layers > model.num_layers:
            raise ValueError(f"draft_num_layers {num_layers} exceeds the draft model's {model.num_layers} layers")
        self.base = model
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, model.num_kv_heads, model.head_dim

    def forward(self, input_ids, positions, kv_cache, attn_meta) -> torch.Tensor:
        m = self.base
        h = m.embed_tokens(input_ids)                                     # (T, hidden)
        cos, sin = m.cos_sin[positions].to(h.dtype).unbind(1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for i in range(self.num_layers):
            h = m.layers[i](h, cos, sin, kv_cache[:, i], attn_meta)
        return m.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.compute_logits(hidden)


class DraftModelProposer:
    """k-step drafts from a second model (see the module docstring for its KV layout)."""

    def __init__(self, config: SpeculativeConfig, runner, max_len: int,
                 get_block_ids: Callable[[str], list[int]]) -> None:
        self.config, self.runner, self.max_len, self.get_block_ids = config, runner, max_len, get_block_ids
        self._computed: dict[str, tuple[int, int]] = {}   # request id -> (num_preemptions, draft tokens computed)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> None:
        bs = self.runner.block_size
        todo: list[tuple[Request, int, list[int], int]] = []
        seen: dict[str, tuple[int, int]] = {}
        for req in requests:
            req.spec_token_ids, req.spec_draft_probs = [], None
            k = max_drafts(req, self.config.num_speculative_tokens, self.max_len) if can_speculate(req) else 0
            blocks = self.get_block_ids(req.request_id)
            # Draft decode steps write positions up to num_tokens + k - 2: they need slots.
            k = min(k, len(blocks) * bs - req.num_tokens + 1)
            if k <= 0:
                continue
            gen, done = self._computed.get(req.request_id, (req.num_preemptions, 0))
            done = done if gen == req.num_preemptions else 0      # preempted: its blocks (and draft KV) are new
            todo.append((req, k, blocks, done))
            seen[req.request_id] = (req.num_preemptions, req.num_tokens)
        self._computed = seen
        if not todo:
            return
        # Catch up every request in one forward; the last position's logits give draft 1.
        step = [ScheduledRequest(r.request_id, r.all_token_ids[done:], done, blocks, True)
                for r, _, blocks, done in todo]
        reqs = [r for r, _, _, _ in todo]
        first, q = self._next(step, reqs)
        drafts, probs = [[t] for t in first], [[p] for p in q]
        for j in range(1, max(k for _, k, _, _ in todo)):
            live = [i for i, (_, k, _, _) in enumerate(todo) if k > j]
            step = [ScheduledRequest(reqs[i].request_id, [drafts[i][-1]], reqs[i].num_tokens + j - 1,
                                     todo[i][2], True) for i in live]
            for i, t, p in zip(live, *self._next(step, [reqs[i] for i in live])):
                drafts[i].append(t)
                probs[i].append(p)
        for (req, k, _, _), d, p in zip(todo, drafts, probs):
            req.spec_token_ids = d[:k]
            req.spec_draft_probs = None if p[0] is None else torch.stack(p[:k])     # (k, vocab): q for verification

    def _next(self, scheduled: list[ScheduledRequest], reqs: list[Request]) -> tuple[list[int], list]:
        """One draft token per sequence: greedy rows take the argmax; sampling rows draw from the draft's distribution
        q (same temperature / top-k / top-p / min-p as the target) with the request's generator, and return q."""
        r = self.runner
        input_ids, positions, meta = r.build_metadata(SchedulerOutput(scheduled=scheduled))
        hidden = r.model(input_ids, positions, r.kv_cache, meta)
        last = meta.query_start_loc[1:].to(torch.int64) - 1
        logits = r.model.compute_logits(hidden[last]).float()                      # (N, vocab)
        tokens = logits.argmax(dim=-1).tolist()
        probs: list = [None] * len(reqs)
        for i, req in enumerate(reqs):
            sp = req.sampling_params
            if sp.greedy:
                continue
            q = _top_k_top_p_min_p(logits[i:i + 1] / sp.temperature, [sp]).softmax(dim=-1)[0]
            gen = request_generator(req, logits.device)
            tokens[i] = int((q / torch.empty_like(q).exponential_(generator=gen)).argmax())
            probs[i] = q
        return tokens, probs


def create_proposer(config: SpeculativeConfig, max_len: int, draft_runner=None,
                    get_block_ids: Callable[[str], list[int]] | None = None):
    if config.method == "ngram":
        return NgramProposer(config, max_len)
    return DraftModelProposer(config, draft_runner, max_len, get_block_ids)


def load_draft_model(config: SpeculativeConfig, engine_config, loaded, device: torch.device) -> torch.nn.Module:
    """The draft: the target's own weights when ``model`` is omitted or names the target, else a second model loaded
    like the target (same dtype and attention backend) that must share its vocabulary; optionally truncated."""
    from dataclasses import replace

    from pdserve.runtime.model_loader import load_model

    target_cfg = engine_config.model
    if config.model is None or config.model == target_cfg.model:
        model = loaded.model
    else:
        other = load_model(replace(target_cfg, model=config.model, tokenizer=None, served_model_name=None),
                           device, engine_config.attention_backend)
        if int(other.hf_config.vocab_size) != int(loaded.hf_config.vocab_size) or \
                other.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
            raise ValueError(f"draft model {config.model!r} does not share the target model's tokenizer")
        model = other.model
    n = config.draft_num_layers
    return TruncatedModel(model, n) if n is not None and n != model.num_layers else model
