"""Multi-LoRA in the engine: float32 greedy parity with transformers + PEFT for base and two adapters in ONE batch,
adapter identity in the prefix cache (digest, not name), LRU slots with max_loras=1, KV events naming the adapter."""

from __future__ import annotations

import pytest

from pdserve.runtime import LLM, SamplingParams

from tests.support.lora import ADAPTERS, MAX_NEW, make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
NAMES = [None, *ADAPTERS]


@pytest.fixture(scope="module")
def llm(adapter_dirs):
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=2)
    for name, path in adapter_dirs.items():
        llm.engine.add_lora(name, str(path))
    yield llm
    llm.shutdown()


def test_adapters_change_the_output(hf_refs):
    """Guards the fixture: if an adapter equalled the base model, the parity tests below would prove nothing."""
    assert hf_refs["attn8"] != hf_refs[None] and hf_refs["mlp16"] != hf_refs[None]
    assert hf_refs["attn8"] != hf_refs["mlp16"]


def test_mixed_batch_matches_transformers_peft(llm, prompt_ids, hf_refs):
    lora = llm.engine.lora
    mixed_before = lora.num_mixed_steps
    prompts = [p for p in prompt_ids for _ in NAMES]
    names = [n for _ in prompt_ids for n in NAMES]
    outs = llm.generate(prompts, GREEDY, lora_name=names)
    for name in NAMES:
        got = [o.outputs[0].token_ids for o, n in zip(outs, names) if n == name]
        assert got == hf_refs[name], name
    # The batch really mixed: steps ran base rows and both adapters' slots together.
    assert lora.num_mixed_steps > mixed_before
    assert lora.requests_total["attn8"] >= len(prompt_ids) and lora.requests_total["mlp16"] >= len(prompt_ids)
    # ... and equals separate runs of pdserve, one per adapter (cold cache each, no mixed step)
    for name in NAMES:
        llm.engine.reset_prefix_cache()
        mixed_before = lora.num_mixed_steps
        alone = llm.generate(prompt_ids, GREEDY, lora_name=name)
        assert lora.num_mixed_steps == mixed_before
        assert [o.outputs[0].token_ids for o in alone] == \
            [o.outputs[0].token_ids for o, n in zip(outs, names) if n == name], name


def test_base_and_adapter_never_share_cached_blocks(llm, prompt_ids, hf_refs, adapter_dirs, tmp_path):
    engine = llm.engine
    prompt = prompt_ids[1] * 4                        # several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.reset_prefix_cache()
    engine.take_kv_events()
    base = llm.generate([prompt], params)[0]
    first = llm.generate([prompt], params, lora_name="attn8")[0]
    assert first.num_cached_tokens == 0               # the base model's blocks are not the adapter's
    again = llm.generate([prompt], params, lora_name="attn8")[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert base.outputs[0].token_ids != first.outputs[0].token_ids
    stored = [e for e in engine.take_kv_events() if type(e).__name__ == "BlockStored"]
    assert {e.lora_name for e in stored} == {None, "attn8"}
    # Other weights under the same name: a new digest, so the old KV is never served.
    engine.remove_lora("attn8")
    engine.add_lora("attn8", str(adapter_dirs["mlp16"]))
    try:
        swapped = llm.generate([prompt], params, lora_name="attn8")[0]
        assert swapped.num_cached_tokens == 0
        direct = llm.generate([prompt], params, lora_name="mlp16")[0]
        assert swapped.outputs[0].token_ids == direct.outputs[0].token_ids
        assert direct.num_cached_tokens > 0           # same weights under another name: same digest, shared KV
    finally:
        engine.remove_lora("attn8")
        engine.add_lora("attn8", str(adapter_dirs["attn8"]))
    out = llm.generate(prompt_ids[:1], GREEDY, lora_name="attn8")[0]
    assert out.outputs[0].token_ids == hf_refs["attn8"][0]


def test_unknown_adapter_is_refused(llm, prompt_ids):
    from pdserve.runtime.lora_manager import LoRANotFound

    with pytest.raises(LoRANotFound):
        llm.engine.add_request("x", prompt_ids[0], GREEDY, lora_name="nope")
    assert "x" not in llm.engine._requests


def test_lru_slots_with_one_slot(adapter_dirs, prompt_ids, hf_refs, tmp_path):
    """max_loras=1, max_cpu_loras=1, three adapters submitted together: never two in one step, all correct, and the
    CPU cache re-reads evicted adapters from disk. Steps of 4 tokens on top (chunked prefill): an adapter's prompt
    spans steps and slot swaps, and every chunk runs with its own adapter's weights."""
    third = make_adapter(tmp_path / "third", 4, 8, ["v_proj", "down_proj"], False, seed=7, b_std=0.3)
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64, enable_lora=True, max_loras=1,
              max_lora_rank=16, max_cpu_loras=1, max_num_batched_tokens=4, enable_prefix_caching=False)
    try:
        engine = llm.engine
        for name, path in adapter_dirs.items():
            engine.add_lora(name, str(path))
        engine.add_lora("third", str(third))
        assert len(engine.lora.cpu) == 1              # only the most recent stays loaded on CPU
        names = ["attn8", "mlp16", None, "third", "attn8"]
        prompts = [prompt_ids[0]] * len(names)
        seen_slots = []
        orig = engine.lora.step_context

        def spy(lora_ids, num_tokens, device):
            seen_slots.append({i for i in lora_ids if i})
            return orig(lora_ids, num_tokens, device)

        engine.lora.step_context = spy
        outs = llm.generate(prompts, GREEDY, lora_name=names)
        for o, n in zip(outs, names):
            if n in hf_refs:
                assert o.outputs[0].token_ids == hf_refs[n][0], n
        assert max(len(s) for s in seen_slots) == 1   # one slot: adapters took turns
        assert engine.lora.num_slot_loads >= 3 and engine.lora.num_mixed_steps == 0
        assert outs[3].outputs[0].token_ids != hf_refs[None][0]
        assert len(engine.lora.cpu) <= 1 and all(a.ref_count == 0 for a in engine.lora.cpu.values())
    finally:
        llm.shutdown()
