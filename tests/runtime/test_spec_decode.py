"""Speculative decoding on the real default model (float32, CPU): it never changes greedy output, and sampling keeps
its distribution.

- Greedy parity: the engine parity prompt set (tests/runtime/test_engine_vs_hf.py: 20 prompts, 1 to ~1,500 tokens),
  all submitted together, with chunked prefill (a 128-token step budget) and a pool so small that requests are
  preempted, with n-gram lookup and with a draft model (the default model's first layers): token ids and logprobs equal
  the run without speculation, and the run proposed drafts, accepted some and rejected some.
- Stop strings inside an accepted run end the output at the same token; prefix-cache hits on blocks written while
  speculating give the same continuation.
- Metrics: a full-model self-draft accepts everything, so every counter is hand-computable.
- Sampling at temperature 1.0: the same seed twice gives the same output; over many seeds the n-gram-speculated
  token's distribution matches the model's exact probabilities (chi-square, stated threshold); the draft model's
  sampled drafts (q) reproduce per seed (the p/q rule itself: tests/runtime/test_spec_decode_unit.py).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pdserve.runtime import LLM, SamplingParams
from tests.support.hf_reference import parity_prompts
from tests.support.parity import parity_llm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 10}
SMALL = dict(dtype="float32", max_model_len=2048, num_gpu_blocks=112, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def base():
    with parity_llm() as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts(base):
    return parity_prompts(base.tokenizer)


@pytest.fixture(scope="module")
def reference(base, prompts):
    return base.generate(prompts, GREEDY)


def _same(got, ref) -> None:
    """Token ids equal; each emitted token's logprob equal to the non-speculative one (float32, other batch shapes)."""
    for i, (g, r) in enumerate(zip(got, ref)):
        a, b = g.outputs[0], r.outputs[0]
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason and a.text == b.text
        for j, (la, lb) in enumerate(zip(a.logprobs, b.logprobs)):
            t = a.token_ids[j]
            assert la[t] == pytest.approx(lb[t], abs=1e-3), (i, j)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_greedy_parity_batched_chunked_preempted(spec, prompts, reference):
    llm = LLM(speculative_config=spec, **SMALL)
    got = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    llm.shutdown()
    _same(got, reference)
    sd = stats.spec_decode
    assert stats.num_preemptions > 0                                   # preemption was forced
    assert max(map(len, prompts)) > SMALL["max_num_batched_tokens"]    # and prompts were chunked
    assert sd.num_drafts > 0 and 0 < sd.num_accepted_tokens < sd.num_draft_tokens, sd   # accepted AND rejected
    # every emitted token is a sample (one per verification or plain decode) or an accepted draft
    assert stats.generation_tokens >= sum(len(o.outputs[0].token_ids) for o in got)


def test_stop_string_inside_accepted_run_and_prefix_cache(base):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20. Again: 1, 2, 3,"
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["12,"]),
              SamplingParams(temperature=0, max_tokens=40, stop=["17"], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=7)]
    ref = base.generate([prompt] * 3, params)
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=256, speculative_config=NGRAM)
    got = llm.generate([prompt] * 3, params)
    sd = llm.get_stats().spec_decode
    assert sd.num_accepted_tokens_per_pos[1] > 0                       # runs of >= 2 accepted tokens happened
    for g, r in zip(got, ref):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == \
            (r.outputs[0].token_ids, r.outputs[0].text, r.outputs[0].finish_reason)
    assert len(got[2].outputs[0].token_ids) == 7
    # Continue from prompt + output: the spec engine's cached blocks (written while speculating) are hit.
    ext = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in got[:2]]
    hits = llm.get_stats().prefix_cache_hits
    cont = llm.generate(ext, SamplingParams(temperature=0, max_tokens=8))
    assert llm.get_stats().prefix_cache_hits - hits >= 32
    assert [o.outputs[0].token_ids for o in cont] == \
        [o.outputs[0].token_ids for o in base.generate(ext, SamplingParams(temperature=0, max_tokens=8))]
    llm.shutdown()


def test_metrics_exact_with_self_draft(base):
    """Draft = a second copy of the target (loaded from its path): every greedy draft is accepted. max_tokens 10,
    k 3: prefill gives token 1; then 3 drafts + bonus (5 tokens); 3 drafts + bonus (9); then only 1 token is left, so
    no drafts: 2 verifications, 6 draft tokens, 6 accepted, 2 at each position."""
    from pdserve.runtime.metrics import ServerMetrics

    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64, speculative_config={
        "method": "draft_model", "model": str(base.engine.model_path), "num_speculative_tokens": 3})
    assert llm.engine.runner.proposer.model is not llm.engine.model             # really a second model
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = llm.generate("The capital of France is", p)[0]
    assert out.outputs[0].token_ids == base.generate("The capital of France is", p)[0].outputs[0].token_ids
    stats = llm.get_stats()
    sd = stats.spec_decode
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, sd.num_accepted_tokens_per_pos) == \
        (2, 6, 6, [2, 2, 2])
    assert stats.generation_tokens == 10
    m = ServerMetrics("m")
    m.set_engine_stats(stats)
    text = m.render().decode()
    for line in ['vllm:spec_decode_num_drafts_total{model_name="m"} 2.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 6.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0']:
        assert line in text, line
    llm.shutdown()
    m.set_engine_stats(base.get_stats())                                         # speculation off: no spec metrics
    assert "spec_decode" not in m.render().decode()


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is the one-sided 0.001 level."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_draft_model_sampling_seeded():
    """The draft model samples its drafts from q (accepted with min(1, p/q); the rule itself is tested statistically
    in test_spec_decode_unit.py): seeded requests reproduce, and some drafts are accepted, some rejected."""
    from pdserve.runtime.model_runner import kv_block_bytes

    budget = 64 << 20
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=budget, speculative_config=DRAFT)
    m, d = llm.engine.model, llm.engine.runner.proposer.model
    per_block = kv_block_bytes(m.num_layers, 16, m.num_kv_heads, m.head_dim, torch.float32) + \
        kv_block_bytes(d.num_layers, 16, d.num_kv_heads, d.head_dim, torch.float32)
    assert d.num_layers == DRAFT["draft_num_layers"]
    # one block id addresses both caches, so the budget pays for both
    assert llm.engine.runner.kv_cache.shape[0] == llm.engine.runner.proposer.kv_cache.shape[0] == budget // per_block
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s, ignore_eos=True) for s in range(8)]
    first = [o.outputs[0].token_ids for o in llm.generate(["a b c d a b c d a b c"] * 8, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(["a b c d a b c d a b c"] * 8, params)] == first
    assert len({tuple(t) for t in first}) > 1                                   # really sampling
    sd = llm.get_stats().spec_decode
    assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens, sd
    llm.shutdown()


def test_sampling_seeded_and_distribution_preserving(base):
    """A prompt whose continuation n-gram lookup drafts (1 draft); 240 seeds, 3 tokens at temperature 1.0: token 2 is
    decided by rejection sampling whenever a draft was proposed. Among outputs whose token 1 is the most common one, token 2's counts are
    compared with the model's exact next-token probabilities (raw logprobs of prompt + token 1): chi-square over the
    categories expecting >= 5 samples plus one pooled 'other', refused above the 0.001 quantile."""
    prompt = "a b c d a b c d a b c"
    n = 240
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=512, max_num_seqs=256,
              max_num_batched_tokens=4096, speculative_config={**NGRAM, "num_speculative_tokens": 1})
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    outs = [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * n, params)]
    sd = llm.get_stats().spec_decode
    assert sd.num_drafts >= n // 4 and 0 < sd.num_accepted_tokens < sd.num_draft_tokens, sd
    again = [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * 20, params[:20])]
    assert again == outs[:20]                                                     # same seed, same output
    llm.shutdown()
    first = Counter(o[0] for o in outs).most_common(1)[0][0]
    second = Counter(o[1] for o in outs if o[0] == first)
    total = sum(second.values())
    assert total >= 100
    ids = base.tokenizer.encode(prompt, add_special_tokens=False) + [first]
    lp = base.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]
    probs = {t: math.exp(v) for t, v in lp.items()}
    cats = [t for t, p in probs.items() if p * total >= 5]
    other_p = 1 - sum(probs[t] for t in cats)
    obs = [second.get(t, 0) for t in cats] + [total - sum(second.get(t, 0) for t in cats)]
    exp = [probs[t] * total for t in cats] + [other_p * total]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    assert chi2 < _chi2_critical(len(cats)), (chi2, obs, exp)
