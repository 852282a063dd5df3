"""Drive an ``LLMEngine`` by hand until requests finish (tests that step it directly instead of through ``LLM``)."""

from __future__ import annotations

import time


def step_until_finished(engine, num_requests: int, timeout: float = 300.0) -> dict:
    """Step until ``num_requests`` outputs have finished -> {request id: final RequestOutput}. Stops at the last
    finish, not when held blocks are released (a prefill keeps leases for its decode peer)."""
    done, deadline = {}, time.monotonic() + timeout
    while len(done) < num_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert time.monotonic() < deadline, f"requests not finished after {timeout}s"
    return done
