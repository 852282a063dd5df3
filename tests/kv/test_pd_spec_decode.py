"""Speculative decoding on a decode pod after a KV transfer (disk connector, default model, one process): the prefill
pod computes the prompts' KV and hands it over; decode pods speculating with n-gram lookup and with a draft model (the
default model's first layers: its own KV is not transferred, it catches up locally) produce exactly the monolithic
greedy output, having loaded the remote blocks and accepted some drafts."""

from __future__ import annotations

import pytest

from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from tests.kv.test_pd_engine import DTYPE, _pump, _run

pytestmark = pytest.mark.slow

BLOCKS = 96
MAX_TOKENS = 12
TEXTS = {
    "list": "Shopping list: apples, bananas, carrots, dates, eggs, flour, grapes, honey. Shopping list again: apples, "
            "bananas, carrots,",
    "count": "Counting: one, two, three, four, five, six, seven, eight, nine, ten. Counting again: one, two, three,",
}


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 16}], ids=["ngram", "draft_model"])
def test_decode_pod_speculates_after_kv_transfer(spec, tmp_path):
    cfg = {"path": str(tmp_path)}
    mono = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE)   # exact equality across batchings: float32 (see DTYPE)
    prompts = {k: mono.tokenizer.encode(v, add_special_tokens=False) for k, v in TEXTS.items()}
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = {k: o.outputs[0].token_ids for k, o in zip(prompts, mono.generate(list(prompts.values()), greedy))}
    mono.shutdown()
    prefill = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE, kv_connector="disk", kv_role="prefill", kv_connector_config=cfg)
    decode = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE, kv_connector="disk", kv_role="decode", kv_connector_config=cfg,
                 speculative_config=spec)
    try:
        handed = _run(prefill.engine, [(k, p, 1, {"do_remote_decode": True, "do_remote_prefill": False})
                                       for k, p in prompts.items()])
        outs = _run(decode.engine, [(k, prompts[k], MAX_TOKENS, handed[k].kv_transfer_params) for k in prompts])
        _pump(prefill.engine)
        for k in prompts:
            assert outs[k].error is None and outs[k].outputs[0].token_ids == expected[k], k
            # the prompt's KV came remote (every full block; the last prompt token is always recomputed)
            assert outs[k].num_cached_tokens == min(len(prompts[k]) // 16 * 16, len(prompts[k]) - 1)
        assert decode.engine.connector.metrics()["kv_blocks_loaded"] > 0
        sd = decode.engine.get_stats().spec_decode
        assert sd.num_drafts > 0 and sd.num_accepted_tokens > 0, sd
    finally:
        prefill.shutdown()
        decode.shutdown()
