"""Batched sampling from the logits of the sequences that reached their end this step.

Order (vLLM/HF): penalties and min_tokens masking on the raw logits -> greedy rows take the argmax -> temperature ->
top-k -> top-p -> min-p -> a random draw (exponential race, so a seeded row uses only its own generator).
Logprobs are reported from the raw model distribution (log_softmax of the unprocessed logits), as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pdserve.runtime.request import Request
from pdserve.runtime.scheduler import SampledToken


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampledToken]:
        """logits: (N, vocab) float32, row i belongs to requests[i]. Returns one sampled token per row."""
        raw = logits
        logits = logits.clone() if any(_needs_processing(r) for r in requests) else logits
        for i, req in enumerate(requests):
            sp = req.sampling_params
            if sp.has_penalties:
                _apply_penalties(logits[i], req, self.device)
            if req.num_output_tokens < sp.min_tokens:
                banned = list(sp.stop_token_ids) + ([req.eos_token_id] if req.eos_token_id is not None else [])
                if banned:
                    logits[i, banned] = float("-inf")

        greedy = [r.sampling_params.greedy for r in requests]
        token_ids = logits.argmax(dim=-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sub = logits[rows] / torch.tensor([requests[i].sampling_params.temperature for i in rows],
                                              device=logits.device, dtype=logits.dtype).unsqueeze(1)
            sub = _top_k_top_p_min_p(sub, [requests[i].sampling_params for i in rows])
            probs = sub.softmax(dim=-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(rows):
                req = requests[i]
                if req.sampling_params.seed is not None:
                    if req.generator is None:
                        req.generator = torch.Generator(device=logits.device).manual_seed(req.sampling_params.seed)
                    q[j].exponential_(generator=req.generator)
                else:
                    q[j].exponential_()
            token_ids[rows] = (probs / q).argmax(dim=-1)

        ids = token_ids.tolist()
        out = [SampledToken(t) for t in ids]
        want = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if want:
            lp = raw[want].float().log_softmax(dim=-1)
            k = max(requests[i].sampling_params.logprobs for i in want)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            chosen = lp.gather(1, token_ids[want].unsqueeze(1)).squeeze(1).tolist()
            for j, i in enumerate(want):
                n = requests[i].sampling_params.logprobs
                d = {ids[i]: chosen[j]}
                if n:   # tokens a grammar refused (-inf) are no alternatives (and -inf is no JSON number)
                    d.update((t, v) for t, v in zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()) if v > -math.inf)
                out[i].logprobs, out[i].logprob = d, chosen[j]
        return out


def _needs_processing(req: Request) -> bool:
    sp = req.sampling_params
    return sp.has_penalties or req.num_output_tokens < sp.min_tokens or not sp.greedy


def _apply_penalties(row: torch.Tensor, req: Request, device: torch.device) -> None:
    sp = req.sampling_params
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), device=device, dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, device=device, dtype=torch.long)
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
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if any(p > 0 for p in min_p):
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits
