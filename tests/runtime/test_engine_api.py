"""LLMEngine / LLM API on the real default model: validation, aborts, n > 1 with seeds, stop strings, logprobs, KV
events, chat, and that the KV cache tensor is the only KV storage and is sized by the block count."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kv_connectors.base import KVCacheSpec
from pdserve.runtime import LLM, SamplingParams
from pdserve.runtime.block_hash import hash_token_blocks
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.kv_events import BlockStored
from pdserve.runtime.model_runner import determine_num_blocks

pytestmark = pytest.mark.slow
BLOCKS = 64


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=BLOCKS)
    yield llm
    llm.shutdown()


def test_kv_cache_is_sized_by_block_count_and_is_the_only_kv(llm):
    engine = llm.engine
    spec: KVCacheSpec = engine.kv_cache_spec
    kv = engine.runner.kv_cache
    assert kv.shape == (BLOCKS, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    assert kv.nbytes == BLOCKS * spec.block_bytes
    model_bytes = lambda: sum(t.nbytes for t in [*engine.model.parameters(), *engine.model.buffers()])  # noqa: E731
    before, ptr = model_bytes(), kv.data_ptr()
    llm.generate(["Tell me a story about a dragon."] * 3, SamplingParams(temperature=0.0, max_tokens=24))
    assert model_bytes() == before and engine.runner.kv_cache.data_ptr() == ptr   # no KV stored anywhere else
    assert engine.get_stats().kv_cache_usage == 0.0


def test_num_blocks_from_memory_budget():
    bb = 2 * 30 * 16 * 3 * 64 * 4
    cfg = EngineConfig.from_options(kv_cache_memory_bytes=100 * bb + 5, max_num_seqs=64)
    assert determine_num_blocks(cfg, bb, 2048, torch.device("cpu")) == 100
    cfg = EngineConfig.from_options(kv_cache_memory_bytes=10**12, max_num_seqs=2)
    assert determine_num_blocks(cfg, bb, 2048, torch.device("cpu")) == 2 * 128     # capped by max_num_seqs*len
    cfg = EngineConfig.from_options(num_gpu_blocks=7, kv_cache_memory_bytes=10**12)
    assert determine_num_blocks(cfg, bb, 2048, torch.device("cpu")) == 7


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ([1, 2, 10**9], SamplingParams(), "token ids"),
    ("hi", SamplingParams(max_tokens=600), "context length"),
    (list(range(100, 610)), SamplingParams(max_tokens=10), "context length"),
])
def test_add_request_rejects_bad_input(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_id_and_pool_too_small():
    small = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=4)
    e = small.engine
    e.add_request("x", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("x", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="KV blocks"):
        e.add_request("y", list(range(100, 160)), SamplingParams(max_tokens=8))
    e.abort_request(["x"])
    assert not e.has_unfinished_requests()


def test_abort_frees_blocks_and_others_continue(llm):
    e = llm.engine
    e.add_request("a", "Write a long essay about the sea.", SamplingParams(temperature=0.0, max_tokens=40))
    e.add_request("b", "Count to ten:", SamplingParams(temperature=0.0, max_tokens=5))
    e.step()
    used = e.get_stats().kv_cache_usage
    e.abort_request("a")
    assert 0 < e.get_stats().kv_cache_usage < used
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert {o.request_id for o in outs} == {"b"} and outs[-1].finished
    assert e.get_stats().kv_cache_usage == 0.0


def test_n_with_seed_is_reproducible(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a, b = llm.generate("My favourite colour is", p)[0], llm.generate("My favourite colour is", p)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stop_string_logprobs_and_text(llm):
    tok = llm.tokenizer
    base = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)
    stop = base.text[8:12]
    cut = llm.generate("The capital of France is",
                       SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], logprobs=2))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)] and base.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert len(cut.logprobs) == len(cut.token_ids) and all(t in lp for t, lp in zip(cut.token_ids, cut.logprobs))
    assert math.isclose(cut.cumulative_logprob, sum(lp[t] for t, lp in zip(cut.token_ids, cut.logprobs)), rel_tol=1e-5)


def test_kv_events_and_chat(llm):
    e = llm.engine
    e.take_kv_events()
    messages = [{"role": "user", "content": "Say hello in French, please, and nothing else at all."}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))[0]
    ids = e.apply_chat_template(messages)
    assert out.prompt_token_ids == ids and out.outputs[0].text
    stored = [h for ev in e.take_kv_events() if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert stored[: len(ids) // 16] == hash_token_blocks(ids, 16)
    assert e.take_kv_events() == []
