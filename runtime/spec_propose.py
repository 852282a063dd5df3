"""Draft proposers, run by the model runner right after sampling (as vLLM v1 does): each request that just sampled
gets up to k draft tokens in ``ModelRunnerOutput.spec_token_ids``; the scheduler keeps them on the request, caps them
(budget, max_tokens) and sends them as extra query tokens of the next step (``scheduled_spec_decode_tokens``), where
the target verifies them in the same forward pass (pdserve.runtime.rejection_sampler).

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

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.runtime import huge_pages
from pdserve.runtime.input_batch import CachedRequestState
from pdserve.runtime.sampler import _top_k_top_p_min_p
from pdserve.runtime.spec_config import SpeculativeConfig


def max_drafts(state: CachedRequestState, k: int, max_len: int) -> int:
    """Drafts worth proposing: none for requests whose logits processing depends on the tokens before each position
    (penalties, an active min_tokens mask); never past max_tokens or max_len (a step emits at most drafts + 1)."""
    sp = state.sampling_params
    if sp.has_penalties or state.num_output_tokens < sp.min_tokens:
        return 0
    k = min(k, max_len - len(state.token_ids) - 1)
    if sp.max_tokens is not None:
        k = min(k, sp.max_tokens - state.num_output_tokens - 1)
    return max(0, k)


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

    def propose(self, states: Sequence[CachedRequestState], batch_size: int) -> dict[str, list[int]]:
        """Drafts for the requests that just sampled (their tokens already appended)."""
        c, out = self.config, {}
        if c.disable_by_batch_size is not None and batch_size >= c.disable_by_batch_size:
            return out
        for st in states:
            k = max_drafts(st, c.num_speculative_tokens, self.max_len)
            d = ngram_lookup(np.asarray(st.token_ids, dtype=np.int64), c.prompt_lookup_min, c.prompt_lookup_max,
                             k) if k else []
            if d:
                out[st.req_id] = d
        return out

    def forget(self, req_ids) -> None:
        pass

    def draft_probs(self, req_id: str) -> None:
        return None


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

    def __init__(self, config: SpeculativeConfig, model: torch.nn.Module, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, max_len: int) -> None:
        self.config, self.model, self.block_size, self.device, self.max_len = config, model, block_size, device, max_len
        # (num_blocks, draft layers, 2, block_size, kv heads, head_dim), addressed by the target's block ids
        self.kv_cache = huge_pages.zeros((num_blocks, model.num_layers, 2, block_size, model.num_kv_heads,
                                           model.head_dim), dtype, device)
        self._computed: dict[str, int] = {}     # request id -> tokens whose draft KV is computed
        self._probs: dict[str, torch.Tensor] = {}   # request id -> (k, vocab) q of its sampled drafts

    def forget(self, req_ids) -> None:
        """Finished or preempted (a resumed request gets new blocks: its draft KV is recomputed)."""
        for r in req_ids:
            self._computed.pop(r, None)
            self._probs.pop(r, None)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self._probs.get(req_id)

    @torch.inference_mode()
    def propose(self, states: Sequence[CachedRequestState], batch_size: int) -> dict[str, list[int]]:
        c, bs = self.config, self.block_size
        todo: list[tuple[CachedRequestState, int, int]] = []
        for st in states:
            self._probs.pop(st.req_id, None)
            if c.disable_by_batch_size is not None and batch_size >= c.disable_by_batch_size:
                continue
            # Draft decode steps write positions up to len(tokens) + k - 2: they need slots.
            k = min(max_drafts(st, c.num_speculative_tokens, self.max_len), len(st.block_ids) * bs - len(st.token_ids) + 1)
            if k > 0:
                # (only tokens the scheduler counts as computed are surely final: a discarded sample is re-fed)
                todo.append((st, k, min(self._computed.get(st.req_id, 0), st.num_computed_tokens)))
        if not todo:
            return {}
        # Catch up every request in one forward (prefill, tokens accepted last step); its last logits give draft 1.
        first, q = self._next([st.token_ids[done:] for st, _, done in todo], [done for _, _, done in todo], todo)
        drafts, probs = [[t] for t in first], [[p] for p in q]
        for st, _, _ in todo:
            self._computed[st.req_id] = len(st.token_ids)   # draft KV past it is scratch, rewritten next time
        for j in range(1, max(k for _, k, _ in todo)):
            live = [i for i, (_, k, _) in enumerate(todo) if k > j]
            toks, ps = self._next([[drafts[i][-1]] for i in live], [len(todo[i][0].token_ids) + j - 1 for i in live],
                                  [todo[i] for i in live])
            for i, t, p in zip(live, toks, ps):
                drafts[i].append(t)
                probs[i].append(p)
        out = {}
        for (st, k, _), d, p in zip(todo, drafts, probs):
            out[st.req_id] = d[:k]
            if p[0] is not None:
                self._probs[st.req_id] = torch.stack(p[:k])                           # (k, vocab)
        return out

    def _next(self, tokens: list[list[int]], starts: list[int], todo) -> tuple[list[int], list]:
        """One draft token per sequence: greedy rows take the argmax; sampling rows draw from the draft's distribution
        q (same temperature / top-k / top-p / min-p as the target) with the request's generator, and return q."""
        from pdserve.runtime.model_runner import attention_inputs

        input_ids, positions, meta = attention_inputs(tokens, starts, [st.block_ids for st, _, _ in todo],
                                                      self.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        last = meta.query_start_loc[1:].to(torch.int64) - 1
        logits = self.model.compute_logits(hidden[last]).float()                      # (N, vocab)
        out = logits.argmax(dim=-1).tolist()
        probs: list = [None] * len(todo)
        for i, (st, _, _) in enumerate(todo):
            sp = st.sampling_params
            if sp.greedy:
                continue
            if sp.seed is not None and st.generator is None:
                st.generator = torch.Generator(device=logits.device).manual_seed(sp.seed)
            q = _top_k_top_p_min_p(logits[i:i + 1] / sp.temperature, [sp]).softmax(dim=-1)[0]
            out[i] = int((q / torch.empty_like(q).exponential_(generator=st.generator)).argmax())
            probs[i] = q
        return out, probs


def create_proposer(config: SpeculativeConfig, max_len: int, draft: torch.nn.Module | None = None,
                    num_blocks: int = 0, block_size: int = 16, dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None):
    if config.method == "ngram":
        return NgramProposer(config, max_len)
    return DraftModelProposer(config, draft, num_blocks, block_size, dtype, device or torch.device("cpu"), max_len)


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
