"""Two things runtime pods tell the router about themselves (see runtime/drain.py): that they are draining, and
their KV fingerprint.

- A draining pod answers 503 with ``x-pdserve-draining: 1``; ``note_response`` marks it unhealthy at once, so the
  very next pick skips it (the retry of the refused request included) instead of waiting for the next health round.
  The health monitor makes it healthy again only when its ``/health`` answers 200 (a new process at that address).
- ``/health`` carries ``kv_fingerprint``; ``compatible`` pairs a prefill pod with a decode pod only when their
  fingerprints are equal, so during a rollout that changes the model, dtype or block size no handoff crosses
  versions. A pod that advertises none (a vLLM pod, or one not health-checked yet) pairs with any: the decode
  pod's connector still checks the fingerprint before reading and recomputes on a mismatch, so this only costs a
  wasted handoff, never a wrong answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

DRAIN_HEADER = "x-pdserve-draining"  # == runtime/drain.DRAIN_HEADER (the router does not import the runtime)


def note_response(ep: Any, status: int, headers: dict[str, str]) -> None:
    """Called for every upstream response whose headers arrived (lower-case header names)."""
    if status == 503 and headers.get(DRAIN_HEADER) == "1" and ep.healthy:
        ep.healthy = False
        log.info("endpoint %s is draining: no new requests", ep.url)


def fingerprint_from_health(body: bytes) -> str | None:
    """``kv_fingerprint`` of a ``/health`` JSON answer (None when absent or not JSON)."""
    try:
        value = json.loads(body).get("kv_fingerprint")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None


def compatible(prefill: Any, decode: Any) -> bool:
    a, b = prefill.kv_fingerprint, decode.kv_fingerprint
    return a is None or b is None or a == b
