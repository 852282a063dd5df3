"""Greedy float32 output of the engine equals Hugging Face transformers ``generate`` token for token.

Same weights (the default model's cached safetensors directory), the 20 parity prompts of tests/support/hf_reference.py
(raw and chat, 1 to ~1,500 tokens), 64 new tokens, checked four ways: all submitted together; with chunked prefill
forced to 64-token steps; with a pool so small that requests are preempted (and recomputed); and a second run that
hits the prefix cache (full blocks, then the leading tokens of a cached block: copied KV).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import transformers

from pdserve.runtime import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy, parity_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # HF generate is slow on 2 shared cores

MAX_NEW = 64


@pytest.fixture(scope="module")
def engine_llm():
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompts(engine_llm):
    ids = parity_prompts(engine_llm.tokenizer)
    assert len(ids) >= 20 and min(map(len, ids)) == 1 and 1300 <= max(map(len, ids)) <= 1700, sorted(map(len, ids))
    return ids


@pytest.fixture(scope="module")
def hf_reference(engine_llm, prompts):
    """HF greedy continuations, one generate call per prompt (no padding effects). Cached on disk under the pdserve
    cache dir, keyed by the weights file, the transformers/torch versions and the prompts, so that only the first run
    on a machine pays for HF generation."""
    from pdserve.runtime import envs

    model_path = engine_llm.engine.model_path
    eos = engine_llm.engine.eos_token_id
    weights = sorted(model_path.glob("*.safetensors"))
    key = hashlib.sha256(json.dumps([[str(w), w.stat().st_size, w.stat().st_mtime] for w in weights] + [
        transformers.__version__, torch.__version__, prompts, MAX_NEW, eos]).encode()).hexdigest()[:24]
    cache = envs.cache_dir() / "test-refs" / f"hf-greedy-{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    refs = hf_greedy(model_path, prompts, MAX_NEW, eos_token_id=eos)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(refs))
    tmp.replace(cache)
    return refs


def _check(outputs, prompts, refs) -> None:
    mismatches = []
    for i, (out, ids, ref) in enumerate(zip(outputs, prompts, refs)):
        got = out.outputs[0].token_ids
        assert out.prompt_token_ids == ids
        if got != ref:
            k = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            mismatches.append(f"prompt {i} ({len(ids)} tokens): first difference at output token {k}")
    assert not mismatches, mismatches


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_batched_then_prefix_cached(engine_llm, prompts, hf_reference):
    engine = engine_llm.engine
    _check(engine_llm.generate(prompts, GREEDY), prompts, hf_reference)
    hits_before, partial_before = engine.get_stats().prefix_cache_hits, engine.get_stats().prefix_cache_partial_hits
    second = engine_llm.generate(prompts, GREEDY)
    assert engine.get_stats().prefix_cache_hits - hits_before > 1000
    # past its full blocks each prompt also takes its last block's leading tokens from the first run's cached block
    assert engine.get_stats().prefix_cache_partial_hits - partial_before > 50
    assert sum(o.num_cached_tokens for o in second) > 1000
    _check(second, prompts, hf_reference)


def test_small_chunks(prompts, hf_reference):
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=1024, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    _check(llm.generate(prompts, GREEDY), prompts, hf_reference)
    assert llm.get_stats().prefix_cache_hits == 0


def test_preemption(prompts, hf_reference):
    # 128 blocks x 16 = 2,048 token slots: the longest request fits alone, all 20 together do not.
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks=128, max_num_batched_tokens=512)
    _check(llm.generate(prompts, GREEDY), prompts, hf_reference)
    assert llm.get_stats().num_preemptions > 0
