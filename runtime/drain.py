"""What a draining runtime pod tells others, and what it waits for before it exits (used by server.py).

On SIGTERM the server drains: ``/health`` answers 503 at once (readiness goes false, Kubernetes takes the pod out of
its endpoints), new inference requests get 503 with ``DRAIN_HEADER`` so a router drops the pod from its *next* pick
instead of waiting for its next health round (router/drain_signal.py), and the process exits only when ``busy`` is 0
or the grace period is over. ``busy`` counts the requests still streaming *and* the finished requests whose KV blocks
are still leased to a decode reader (a prefill pod's handoffs): exiting earlier would close the side channel under a
decode pod that is still pulling, turning a handoff into a failed load and a recompute.

``/health`` also advertises the pod's KV fingerprint (``kv_connectors.base.KVCacheSpec.fingerprint``: model, dtype,
layout, block size, version), so a router pairs only prefill and decode pods that can exchange KV.
"""

from __future__ import annotations

from typing import Any

DRAIN_HEADER = "x-pdserve-draining"  # value "1" on every 503 a draining pod answers
FINGERPRINT_HEADER = "x-pdserve-kv-fingerprint"


def busy(engine: Any, async_engine: Any) -> int:
    """Requests in flight plus finished requests whose blocks are still held for a remote reader."""
    return async_engine.num_inflight + engine.num_held_for_transfer()   # safe from this thread (an atomic len())


def fingerprint(engine: Any) -> str | None:
    spec = getattr(engine, "kv_cache_spec", None)
    return spec.fingerprint() if spec is not None else None
