"""Sampling filters draw from the right DISTRIBUTION, not only from the right set: seeded single-token draws through the
public `LLM`/`SamplingParams` API, compared with the exact filtered softmax of the model's own next-token distribution.

Which tokens appear in unseeded draws (test_sampling.py) cannot tell a correct sampler from one that draws uniformly
over the allowed set, or one that ignores the temperature inside the set; here each such sampler fails: the expected
frequencies are far from uniform, and the tolerance (4.5 standard deviations of a binomial frequency) is checked to be
tight enough to reject the uniform alternative for every case. Seeds make the draws reproducible.

Reference order (vLLM/HF, runtime/sampler.py): temperature -> top-k -> top-p -> min-p on the raw logits. The raw
distribution comes from the engine itself (`logprobs=20` of a greedy request are the raw log-softmax), so every case
keeps its allowed set inside those top 20 tokens, with no near-ties at a filter's boundary.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pdserve.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

# 17 tokens: after the reference request the first 16 are a cached block, so each draw computes one token.
PROMPT = "Here is a list of fruits I bought at the market today: apples, bananas and"
N = 300          # draws per case
Z = 4.5          # tolerance in binomial standard deviations
CASES = {        # name -> SamplingParams fields
    "top_k=3": dict(top_k=3),
    "top_p=0.6": dict(top_p=0.6),
    "min_p=0.1": dict(min_p=0.1),
    "T=0.5,top_k=10": dict(temperature=0.5, top_k=10),
    "T=2,top_k=10": dict(temperature=2.0, top_k=10),
}


def filtered(raw: dict[int, float], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
             min_p: float = 0.0) -> dict[int, float]:
    """The exact sampling distribution from the raw top-20 logprobs: each case's allowed set lies inside them."""
    order = sorted(raw, key=raw.get, reverse=True)

    def probs(tokens: list[int]) -> dict[int, float]:
        if top_k > 0:          # renormalized over the top-k set at this temperature: exact from the top 20
            m = max(raw[t] / temperature for t in tokens)
            e = {t: math.exp(raw[t] / temperature - m) for t in tokens}
            total = sum(e.values())
            return {t: e[t] / total for t in tokens}
        assert temperature == 1.0, "without top-k only temperature 1 is known exactly from the top 20"
        return {t: math.exp(raw[t]) for t in tokens}  # the full-vocabulary probabilities

    keep = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:            # the smallest prefix whose mass reaches top_p
        p, before, kept = probs(keep), 0.0, []
        for t in keep:
            if before >= top_p:
                break
            kept.append(t)
            before += p[t]
        assert before >= top_p and len(kept) < len(order), "top-p set not inside the top 20"
        assert min(abs(sum(p[t] for t in kept[:i]) - top_p) for i in range(1, len(kept) + 1)) > 0.02, "near-tie"
        keep = kept
    if min_p > 0.0:            # relative to the most likely token (a ratio: normalization does not matter)
        p = probs(keep)
        thresh = max(p.values()) * min_p
        assert all(abs(v - thresh) > 0.1 * thresh for v in p.values()), "near-tie at the min-p threshold"
        keep = [t for t in keep if p[t] >= thresh]
        assert len(keep) < len(order), "min-p set not inside the top 20"
    final = {t: math.exp(raw[t] / temperature) for t in keep}
    return {t: v / sum(final.values()) for t, v in final.items()}


def within(freq: dict[int, float], expected: dict[int, float]) -> bool:
    return all(abs(freq.get(t, 0.0) - p) <= Z * math.sqrt(p * (1 - p) / N) + 1 / N for t, p in expected.items())


@pytest.fixture(scope="module")
def draws() -> tuple[dict[int, float], dict[str, Counter]]:
    llm = LLM(dtype="float32", max_num_seqs=256)  # fewer, larger steps
    try:
        ids = llm.tokenizer.encode(PROMPT)
        ref = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))[0].outputs[0]
        raw = ref.logprobs[0]
        assert len(raw) == 20
        params = [SamplingParams(max_tokens=1, seed=1000 * c + i, **kw)
                  for c, kw in enumerate(CASES.values()) for i in range(N)]
        outs = llm.generate([ids] * len(params), params)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids[0] for o in outs]
    return raw, {name: Counter(tokens[c * N:(c + 1) * N]) for c, name in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_filtered_distribution(draws, case):
    raw, counts = draws
    expected = filtered(raw, **CASES[case])
    freq = {t: n / N for t, n in counts[case].items()}
    assert set(freq) <= set(expected), f"drawn outside the allowed set: {set(freq) - set(expected)}"
    assert within(freq, expected), (
        f"{case}: frequencies {sorted(freq.items(), key=lambda kv: -kv[1])} vs exact {expected}")
    # the test has the power it claims: a uniform draw over the same set, or the unfiltered temperature-1 softmax
    # restricted to it (temperature ignored), would fail
    uniform = {t: 1 / len(expected) for t in expected}
    assert not within(uniform, expected)
    if "temperature" in CASES[case]:
        assert not within(filtered(raw, top_k=CASES[case]["top_k"]), expected)
