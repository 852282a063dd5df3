"""Speculative decoding with LoRA adapters: n-gram drafts verified in the same forward pass as the adapter rows (the
LoRA step context sees the draft-extended query lengths). Base and two adapters in one batch keep float32 greedy parity
with transformers + PEFT, and drafts were proposed, accepted and rejected."""

from __future__ import annotations

from pdserve.runtime import LLM, SamplingParams

from tests.support.lora import ADAPTERS, MAX_NEW

NAMES = [None, *ADAPTERS]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_mixed_lora_batch_with_speculation_matches_transformers_peft(adapter_dirs, prompt_ids, hf_refs):
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=2, speculative_config=SPEC)
    try:
        for name, path in adapter_dirs.items():
            llm.engine.add_lora(name, str(path))
        prompts = [p for p in prompt_ids for _ in NAMES]
        names = [n for _ in prompt_ids for n in NAMES]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora_name=names)
        for name in NAMES:
            got = [o.outputs[0].token_ids for o, n in zip(outs, names) if n == name]
            assert got == hf_refs[name], name
        sd = llm.get_stats().spec_decode
        assert sd.num_drafts > 0 and 0 < sd.num_accepted_tokens < sd.num_draft_tokens, sd
    finally:
        llm.shutdown()
