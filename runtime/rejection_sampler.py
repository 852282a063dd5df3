"""Verification of draft tokens: one forward gave the target's logits at every draft position plus one.

Greedy rows accept the longest prefix of drafts equal to the target's argmax, then the target's own token at the first
mismatch (or the bonus token after the last draft): the emitted tokens are exactly what non-speculative greedy decoding
would have produced, one by one. Random rows use standard speculative rejection sampling (Leviathan et al. 2023, Chen
et al. 2023): draft x at position i is accepted with probability min(1, p_i(x) / q_i(x)); the first rejected position
draws from the residual (p_i - q_i)+ renormalized; if all are accepted the bonus token draws from p_{k}. The emitted
tokens are then distributed exactly as non-speculative sampling from p. Deterministic proposals (n-gram lookup, a
greedy draft model) are q = one-hot(x): accept with probability p(x), residual = p with x removed. Randomness comes from
the request's own generator (seeded requests reproduce). Logprobs are the raw model's at each emitted position, as the
non-speculative sampler reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.runtime.sampler import _top_k_top_p_min_p
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import SampledToken


def rejection_sample(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, uniform: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized rule over R rows of k drafts each.

    p: (R, k+1, V) target probabilities; drafts: (R, k) int64; q: (R, k, V) draft probabilities, or None for
    deterministic proposals; uniform: (R, k) in [0, 1); noise: (R, V) Exp(1) draws for the one final token.
    Returns (num_accepted (R,), final_token (R,)): emit drafts[:num_accepted] then final_token.
    """
    R, k = drafts.shape
    V = p.shape[-1]
    p_d = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)                        # (R, k)
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts.unsqueeze(2)).squeeze(2)
    accepted = uniform * q_d < p_d          # P = min(1, p/q) for u in [0, 1); strict, so p = 0 never accepts
    # a draft q never proposes (q_d = 0) can only come from a caller bug; never accept it
    accepted &= q_d > 0
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)                 # (R,)
    rows = torch.arange(R, device=p.device)
    p_m = p[rows, num_accepted]                                                       # (R, V)
    if q is None:
        q_pad = torch.zeros(R, k + 1, V, dtype=p.dtype, device=p.device)
        q_pad[:, :k].scatter_(2, drafts.unsqueeze(2), 1.0)
    else:
        q_pad = torch.cat([q, torch.zeros(R, 1, V, dtype=p.dtype, device=p.device)], dim=1)
    resid = (p_m - q_pad[rows, num_accepted]).clamp_min(0)                            # bonus row: q = 0 -> p
    mass = resid.sum(dim=1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_m)                 # p == q: any draw from p
    final = (resid / noise).argmax(dim=1)                                             # exponential race
    return num_accepted, final


def verify(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
           drafts: Sequence[Sequence[int]], draft_probs: Sequence[torch.Tensor | None] | None = None
           ) -> list[list[SampledToken]]:
    """logits: (sum(k_i + 1), vocab) float32, request i's k_i + 1 rows consecutive (draft positions, then the bonus).
    Speculated requests carry no penalties and have reached min_tokens (the proposer guarantees it), so the processing
    the plain sampler would apply is only temperature / top-k / top-p / min-p. ``draft_probs[i]``: the draft model's
    (>= k_i, vocab) distribution its sampled drafts came from, None for deterministic drafts. Returns the emitted
    tokens per request."""
    out: list[list[SampledToken]] = []
    argmax = logits.argmax(dim=-1).tolist()
    offset = 0
    for i, (sp, gen, d) in enumerate(zip(params, generators, drafts)):
        k = len(d)
        rows = logits[offset:offset + k + 1]
        if sp.greedy:
            target = argmax[offset:offset + k + 1]
            n = next((j for j in range(k) if target[j] != d[j]), k)
            ids = target[:n + 1]
        else:
            probs = _top_k_top_p_min_p(rows / sp.temperature, [sp] * (k + 1)).softmax(dim=-1)
            uniform = torch.rand(1, k, generator=gen, device=logits.device)
            noise = torch.empty(1, probs.shape[-1], device=logits.device).exponential_(generator=gen)
            q = None if draft_probs is None or draft_probs[i] is None else draft_probs[i][:k].unsqueeze(0)
            dt = torch.tensor([list(d)], dtype=torch.int64, device=logits.device)
            n_t, final = rejection_sample(probs.unsqueeze(0), dt, q, uniform, noise)
            n = int(n_t)
            ids = list(d[:n]) + [int(final)]
        toks = [SampledToken(t) for t in ids]
        if sp.logprobs is not None:
            lp = rows[:len(ids)].log_softmax(dim=-1)
            chosen = lp.gather(1, torch.tensor(ids, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
            top_v, top_i = lp.topk(sp.logprobs, dim=-1) if sp.logprobs else (None, None)
            for j, tok in enumerate(toks):
                entry = {ids[j]: chosen[j]}
                if sp.logprobs:
                    entry.update(zip(top_i[j].tolist(), top_v[j].tolist()))
                tok.logprobs, tok.logprob = entry, chosen[j]
        out.append(toks)
        offset += k + 1
    return out
