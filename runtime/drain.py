"""What a draining runtime pod tells others, and what it waits for before it exits (``drain``, run on SIGTERM).

On SIGTERM the server drains: ``/health`` answers 503 at once (readiness goes false, Kubernetes takes the pod out of
its endpoints), new inference requests get 503 with ``DRAIN_HEADER`` so a router drops the pod from its *next* pick
instead of waiting for its next health round (router/drain_signal.py), and the process exits only when ``busy`` is 0
or the grace period is over. ``busy`` counts the requests still streaming *and* whether the engine still has work,
which includes finished requests whose KV blocks are still leased to a decode reader (a prefill pod's handoffs):
exiting earlier would close the side channel under a decode pod that is still pulling, turning a handoff into a
failed load and a recompute.

``/health`` also advertises the pod's KV fingerprint (``kv_connectors.base.KVCacheSpec.fingerprint``: model, dtype,
layout, block size, version), so a router pairs only prefill and decode pods that can exchange KV.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.server_state import ServerState

logger = logging.getLogger(__name__)

DRAIN_HEADER = "x-pdserve-draining"  # value "1" on every 503 a draining pod answers
FINGERPRINT_HEADER = "x-pdserve-kv-fingerprint"


def busy(async_engine: AsyncEngine) -> int:
    """Requests in flight, plus one while the engine still has work (blocks held for a remote reader included)."""
    working = async_engine.engine_busy and async_engine.dead is None
    return async_engine.num_inflight + int(working)


def fingerprint(engine: EngineClient) -> str:
    return engine.kv_cache_spec.fingerprint()


async def drain(state: ServerState, grace_period_s: float) -> int:
    """Stop taking requests (503), wait up to ``grace_period_s`` for in-flight ones, abort the rest; returns how many
    were aborted. Aborted requests end with ``finish_reason="abort"`` so their clients still get a response."""
    state.draining = True
    ae = state.async_engine
    deadline = time.monotonic() + grace_period_s
    while busy(ae) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    aborted = ae.abort_all()
    if aborted:
        logger.warning("grace period over: aborted %d in-flight request(s)", aborted)
    deadline = time.monotonic() + 5.0   # let aborted responses flush
    while ae.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return aborted
