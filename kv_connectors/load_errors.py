"""Typed KV load failures and the per-connector counters that record them.

Every way a load can go wrong has one exception class whose ``kind`` is the label of the
``kv_load_failures{kind=...}`` counter; connectors catch :class:`KVLoadError`, count it with
:meth:`ConnectorStats.failure` (which also logs the request id) and report the affected block ids to the engine.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("pdserve.kv_connectors")

FAILURE_KINDS = ("missing", "corrupt", "fingerprint", "timeout", "peer_unreachable", "lease_expired")


class KVLoadError(Exception):
    """A block (or a whole request's blocks) could not be loaded; ``kind`` is the metric label."""

    kind = "corrupt"


class MissingBlock(KVLoadError):
    kind = "missing"


class CorruptBlock(KVLoadError):
    """Bad magic/version, checksum mismatch, wrong dtype or shape."""

    kind = "corrupt"


class TruncatedBlock(CorruptBlock):
    pass


class HashMismatch(CorruptBlock):
    """The block's header names a different block hash than the one asked for."""


class FingerprintMismatch(KVLoadError):
    kind = "fingerprint"


class LoadTimeout(KVLoadError):
    kind = "timeout"


class PeerUnreachable(KVLoadError):
    kind = "peer_unreachable"


class LeaseExpired(KVLoadError):
    kind = "lease_expired"


class ConnectorStats:
    """Thread-safe counters, exported through ``KVConnectorBase.metrics()``.

    Names: ``kv_load_failures{kind=...}`` (one per failed request load), ``kv_blocks_loaded``, ``kv_blocks_saved``,
    ``kv_bytes_loaded``, ``kv_bytes_saved``, ``kv_blocks_load_failed``, ``kv_saves_skipped``, ``kv_loads`` and
    ``kv_load_seconds`` (loads ended and their summed wall time: the mean transfer time) and connector extras.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({f"kv_load_failures{{kind={k}}}": 0 for k in FAILURE_KINDS})
        for key in ("kv_blocks_loaded", "kv_bytes_loaded", "kv_blocks_load_failed", "kv_blocks_saved",
                    "kv_bytes_saved", "kv_saves_skipped", "kv_loads", "kv_load_seconds"):
            self._counts[key] = 0

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._counts[key] += value

    def failure(self, error: KVLoadError, request_id: str, num_blocks: int) -> None:
        with self._lock:
            self._counts[f"kv_load_failures{{kind={error.kind}}}"] += 1
            self._counts["kv_blocks_load_failed"] += num_blocks
        logger.warning("%s: KV load failed for request %s (%s, %d blocks): %s",
                       self.name, request_id, error.kind, num_blocks, error)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)
