"""Batched sampling from the logits of the sequences that reached their end this step.

Order (vLLM/HF): grammar bitmask, penalties and min_tokens masking on the raw logits -> greedy rows take the argmax ->
temperature -> top-k -> top-p -> min-p -> a random draw (exponential race, so a seeded row uses only its own
generator; an unseeded row draws from the engine's generator, seeded once from ``--seed``, so a run's unseeded
sampling is reproducible given the same requests in the same order, as in vLLM). Logprobs are reported from the
raw model distribution (log_softmax of the unprocessed logits), as vLLM does. The sampler sees only
``SamplingMetadata`` (built by the runner's persistent batch), never a scheduler request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import fused_cpu
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import SampledToken


@dataclass
class SamplingMetadata:
    """Per row of the logits: the request's parameters and the history the penalties need."""

    req_ids: list[str]
    params: list[SamplingParams]            # temperature, top-k/p, min-p, penalties, logprobs count per row
    generators: list[torch.Generator | None]  # the row's seeded generator (persists across steps), None: the engine's
    all_token_ids: list[list[int]]          # prompt + output (repetition penalty)
    output_token_ids: list[list[int]]       # output only (presence / frequency penalties)
    banned_token_ids: list[list[int]]       # EOS and stop ids while below min_tokens
    # Structured outputs: packed allowed-token bitmask, int32 (N, ceil(vocab / 32)), bit t % 32 of word t // 32 set
    # when token t is allowed (rows not in grammar_rows are all ones); None: no row is constrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None   # the constrained rows

    @property
    def needs_processing(self) -> bool:
        return self.grammar_bitmask is not None or any(
            p.has_penalties or not p.greedy for p in self.params) or any(self.banned_token_ids)


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        # The engine-level generator of unseeded rows (None: torch's global one).
        self.generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """logits: (N, vocab) float32, row i belongs to meta.req_ids[i]. Returns one sampled token per row."""
        raw = logits
        params = meta.params
        logits = logits.clone() if meta.needs_processing else logits
        if meta.grammar_bitmask is not None:   # one batched kernel (xgrammar's) over the constrained rows
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, meta.grammar_bitmask.to(logits.device, non_blocking=True),
                                            indices=meta.grammar_rows)
        for i, sp in enumerate(params):
            if sp.has_penalties:
                _apply_penalties(logits[i], sp, meta.all_token_ids[i], meta.output_token_ids[i], self.device)
            if meta.banned_token_ids[i]:
                logits[i, meta.banned_token_ids[i]] = float("-inf")

        greedy = [p.greedy for p in params]
        token_ids = fused_cpu.argmax(logits)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sub = logits[rows] / torch.tensor([params[i].temperature for i in rows],
                                              device=logits.device, dtype=logits.dtype).unsqueeze(1)
            sub = _top_k_top_p_min_p(sub, [params[i] for i in rows])
            probs = sub.softmax(dim=-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(rows):
                g = meta.generators[i]
                q[j].exponential_(generator=g if g is not None else self.generator)
            token_ids[rows] = fused_cpu.argmax(probs / q)

        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = raw[want].float().log_softmax(dim=-1)
            k = max(params[i].logprobs for i in want)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            chosen = lp.gather(1, token_ids[want].unsqueeze(1)).squeeze(1).tolist()
            for j, i in enumerate(want):
                n = params[i].logprobs
                d = {ids[i]: chosen[j]}
                if n:
                    d.update(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
                out[i].logprobs, out[i].logprob = d, chosen[j]
        return out


def _apply_penalties(row: torch.Tensor, sp: SamplingParams, all_ids: list[int], output_ids: list[int],
                     device: torch.device) -> None:
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(all_ids)), device=device, dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and output_ids:
        out = torch.tensor(output_ids, device=device, dtype=torch.long)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def _top_k_top_p_min_p(logits: torch.Tensor, params) -> torch.Tensor:
    """logits: (n, vocab), already temperature-scaled. Masks filtered tokens with -inf."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = logits.shape[-1]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device).unsqueeze(1)
        pos = torch.arange(vocab, device=logits.device).unsqueeze(0)
        mask = pos >= ks
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        mask |= before >= torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
        mask[:, 0] = False   # explicitly: a top_p below float32's range is 0.0, and 0 >= 0 would mask every token
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits
