"""A prefill handoff's store write runs off the engine thread. While one handoff's write hangs, the other requests keep
stepping to completion; the hung request's response waits (its kv_transfer_params are not valid before its blocks are
in the store) and its blocks stay held; the write's end releases both. A write that outlives ``handoff_timeout_s`` is
answered as before the move (the same signed params, the store marked down: the decode side recomputes what it cannot
find), its blocks still held until the write really ends. Real engine, model and disk connector; the hang is injected
into ``DiskStore.put_many`` (a disk that stops answering cannot be made on demand)."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.kv_connectors.disk_connector import DiskStore
from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams

HANDOFF = {"do_remote_decode": True, "do_remote_prefill": False}
PROMPT = ("Once upon a time in a small village by the sea, there lived an old fisherman who told stories about the "
          "storms he had seen and the strange lights that danced over the water at night.")
OTHER = "def fibonacci(n):"   # under one block: nothing of it is saved


@pytest.fixture
def hung_disk(monkeypatch):
    """Every ``DiskStore.put_many`` blocks until ``gate`` is set (60 s at most; set at teardown)."""
    gate, entered = threading.Event(), threading.Event()
    real = DiskStore.put_many

    def stuck(self, items):
        entered.set()
        gate.wait(60)
        return real(self, items)

    monkeypatch.setattr(DiskStore, "put_many", stuck)
    yield gate, entered
    gate.set()


def _prefill_engine(path, handoff_timeout_s: float) -> LLM:
    return LLM(num_gpu_blocks=64, dtype="float32", kv_connector="disk", kv_role="prefill",
               kv_connector_config={"path": str(path), "handoff_timeout_s": handoff_timeout_s})


def _step_until(engine, done: dict, cond, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert time.monotonic() < deadline, "engine made no progress"


def _stored(path) -> int:
    return len(list(path.glob("*/*/*.kvb")))


def test_hung_handoff_write_does_not_stall_other_requests(tmp_path, hung_disk):
    gate, entered = hung_disk
    llm = _prefill_engine(tmp_path, handoff_timeout_s=60.0)
    engine, done = llm.engine, {}
    engine.add_request("h", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer_params=dict(HANDOFF))
    engine.add_request("n", OTHER, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    _step_until(engine, done, lambda: "n" in done)
    assert entered.is_set() and not gate.is_set()     # h's write is hung...
    assert len(done["n"].outputs[0].token_ids) == 8   # ...while n ran all its steps
    assert "h" not in done                            # h's response waits for valid params
    assert engine.has_pending_kv_transfers() and engine.get_stats().kv_cache_usage > 0   # its blocks are held
    gate.set()
    _step_until(engine, done, lambda: "h" in done)
    params = done["h"].kv_transfer_params
    assert done["h"].error is None and params["do_remote_prefill"] is True
    assert len(params["remote_block_ids"]) == len(params["block_hashes"]) > 0
    assert _stored(tmp_path) == len(params["block_hashes"])   # every listed block is in the store
    _step_until(engine, done, lambda: not engine.has_pending_kv_transfers())
    assert engine.get_stats().kv_cache_usage == 0
    llm.shutdown()


def test_handoff_past_its_deadline_answers_and_keeps_blocks_until_the_write_ends(tmp_path, hung_disk):
    gate, entered = hung_disk
    llm = _prefill_engine(tmp_path, handoff_timeout_s=0.5)
    engine, done = llm.engine, {}
    engine.add_request("h", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_transfer_params=dict(HANDOFF))
    _step_until(engine, done, lambda: "h" in done)
    assert entered.is_set() and not gate.is_set()     # answered at the deadline, the write still hung
    params = done["h"].kv_transfer_params
    assert params["do_remote_prefill"] is True and len(params["block_hashes"]) > 0
    assert engine.connector.metrics()["kv_store_errors"] >= 1
    assert engine.has_pending_kv_transfers() and engine.get_stats().kv_cache_usage > 0   # the write reads them
    gate.set()
    _step_until(engine, done, lambda: not engine.has_pending_kv_transfers())
    assert engine.get_stats().kv_cache_usage == 0
    llm.shutdown()
