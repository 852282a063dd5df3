"""AsyncEngine failure paths that the real engine cannot be made to produce on demand.

The stub below stands in for a crashing engine (a GPU fault, a bug): it is the only fake in the server tests.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError
from pdserve.runtime.sampling_params import SamplingParams


class CrashingEngine:
    def __init__(self) -> None:
        self.requests: list[str] = []

    def add_request(self, request_id, prompt, params, **kwargs):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests.append(request_id)

    def abort_request(self, ids):
        pass

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("device fault")

    def take_kv_events(self):
        return []

    def get_stats(self):
        return None


async def test_engine_value_error_reaches_caller_and_crash_fails_requests():
    ae = AsyncEngine(CrashingEngine(), idle_poll_s=0.05)
    ae.start()
    try:
        with pytest.raises(ValueError, match="empty"):
            await ae.add("bad", [], SamplingParams())
        assert ae.num_inflight == 0
        stream = await ae.add("r1", [1, 2, 3], SamplingParams())
        with pytest.raises(EngineDeadError, match="device fault"):
            await asyncio.wait_for(stream.next(), 10)
        assert ae.dead is not None
        with pytest.raises(EngineDeadError):
            await ae.add("r2", [1], SamplingParams())
    finally:
        ae.stop()


class DyingEngine(CrashingEngine):
    """``step`` blocks until released, then raises: a request added meanwhile is queued as the thread dies."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step, self.release = threading.Event(), threading.Event()

    def step(self):
        self.in_step.set()
        self.release.wait(10)
        raise RuntimeError("device fault")


async def test_request_queued_as_the_engine_dies_is_answered():
    engine = DyingEngine()
    ae = AsyncEngine(engine, idle_poll_s=0.05)
    ae.start()
    try:
        first = await ae.add("r1", [1, 2, 3], SamplingParams())
        assert await asyncio.to_thread(engine.in_step.wait, 10)
        late = asyncio.ensure_future(ae.add("r2", [4, 5], SamplingParams()))   # queued behind the dying step
        await asyncio.sleep(0.05)
        engine.release.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(first.next(), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(late, 10)   # before: its future was never resolved, the caller hung forever
        assert ae.num_inflight == 1   # only r1's stream, which its caller releases
    finally:
        ae.stop()


class AbortRaisingEngine(CrashingEngine):
    def abort_request(self, ids):
        raise KeyError(ids)

    def step(self):
        self.requests.clear()
        return []


async def test_a_failing_command_does_not_stop_the_loop():
    ae = AsyncEngine(AbortRaisingEngine(), idle_poll_s=0.05)
    ae.start()
    try:
        stream = await ae.add("r1", [1], SamplingParams())
        ae.release(stream)                 # queues an abort that raises in the engine thread
        await asyncio.wait_for(ae.add("r2", [2], SamplingParams()), 10)
        assert ae.dead is None
    finally:
        ae.stop()
