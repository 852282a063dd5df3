"""Chunk-wise overlap on the save side (issue 18): a prefill with remote decode that runs as several chunked-prefill
steps hands each step's newly completed full blocks to the store connector's writer at once (checksummed and written
off the engine thread), so the store holds the first chunk's blocks before the last chunk is scheduled and the handoff
only waits for the tail. The decode side then answers exactly as a monolithic engine (float32, greedy)."""

from __future__ import annotations

import pytest

from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from tests.support.stepping import step_until_finished

pytestmark = pytest.mark.slow

CHUNK = 32      # max_num_batched_tokens: two 16-token blocks per prefill step
PROMPT = ("Once upon a time in a small village by the sea, there lived an old fisherman who told stories about the "
          "storms he had seen and the strange lights that danced over the water at night, and the children listened. "
          "Every evening they gathered on the pier, asking which storm had been the worst and whether the lights "
          "would come back, and every evening he told them a different story.")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_prefill_chunks_are_written_as_they_complete_and_decode_matches(tmp_path):
    cfg = {"path": str(tmp_path / "kv")}
    prefill = LLM(num_gpu_blocks=32, dtype="float32", kv_connector="disk", kv_role="prefill", kv_connector_config=cfg,
                  max_num_batched_tokens=CHUNK)
    try:
        toks = prefill.tokenizer.encode(PROMPT, add_special_tokens=False)
        full_blocks = (len(toks) - 1) // 16
        assert len(toks) > 2 * CHUNK and full_blocks >= 4, len(toks)
        engine, conn = prefill.engine, prefill.engine.connector
        engine.add_request("p", toks, _greedy(1), kv_transfer_params={"do_remote_decode": True})
        outs = engine.step()                                 # the first chunk only
        assert not any(o.finished for o in outs)
        conn.flush(30)                                      # let the writer thread catch up (not the engine)
        assert conn.metrics()["kv_blocks_saved"] == CHUNK // 16
        assert len(list(conn.store.root.glob("*/*.kvb"))) == CHUNK // 16   # in the store before chunk 2 runs
        outs = engine.step()
        assert not any(o.finished for o in outs)
        conn.flush(30)
        assert conn.metrics()["kv_blocks_saved"] == 2 * CHUNK // 16
        params = step_until_finished(engine, 1)["p"].kv_transfer_params
        assert conn.metrics()["kv_blocks_saved"] == len(params["block_hashes"])   # each block written once
    finally:
        prefill.shutdown()

    decode = LLM(num_gpu_blocks=32, dtype="float32", kv_connector="disk", kv_role="decode", kv_connector_config=cfg)
    try:
        decode.engine.add_request("d", toks, _greedy(6), kv_transfer_params=params)
        out = step_until_finished(decode.engine, 1)["d"]
        assert decode.engine.connector.metrics()["kv_blocks_loaded"] == full_blocks
    finally:
        decode.shutdown()
    mono = LLM(num_gpu_blocks=32, dtype="float32")
    try:
        expected = mono.generate([toks], _greedy(6))[0].outputs[0].token_ids
    finally:
        mono.shutdown()
    assert out.error is None and out.outputs[0].token_ids == expected
