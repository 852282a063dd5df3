"""AsyncEngine failure paths that the real engine cannot be made to produce on demand.

The stub below stands in for a crashing engine (a GPU fault, a bug): it is the only fake in the server tests.
"""

from __future__ import annotations

import asyncio

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
