"""Prefill-side leases: blocks held for a decode reader until it says done or the lease ends.

``done`` and expiry are decided under one lock, so a reader told "valid" read blocks that were never released; a
late reader (its lease expired, the blocks freed and perhaps reused) is told "expired" and must discard what it read.
A lease also binds each held block's position and content hash, so params edited by a client (other block ids, or
hashes of another prompt) cannot make a decode pod read, and cache under its own hashes, blocks the lease never
covered (cross-request KV leaks or prefix-cache poisoning).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from pdserve.kv_connectors.load_errors import logger


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    block_hashes: list[str]   # hex, position by position: what each held block contains
    expires: float
    state: str = "active"   # active -> done | expired


class LeaseTable:
    """Prefill side: blocks held for a decode reader. ``done`` and expiry are decided under one lock, so a reader
    told "valid" read blocks that were never released."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0

    def grant(self, request_id: str, block_ids: list[int], block_hashes: list[str]) -> str:
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._leases[lease_id] = Lease(request_id, block_ids, block_hashes, time.monotonic() + self.lease_s)
            self._changed.notify_all()
        return lease_id

    def wait_active(self, timeout: float) -> bool:
        """Block until some lease is held (True) or ``timeout`` passes (False)."""
        with self._lock:
            return self._changed.wait_for(lambda: bool(self._leases), timeout)

    def _live(self, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease and lease.state == "active" and time.monotonic() <= lease.expires else None

    def heartbeat(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._live(lease_id)
            if lease:
                lease.expires = time.monotonic() + self.lease_s
            return lease is not None

    def done(self, lease_id: str, blocks: list) -> str:
        """The reader read ``blocks`` = [[position, block id, block hash hex], ...]. Returns "valid" (and releases the
        lease) only if the lease is alive and held exactly those blocks with exactly that content; "expired" or
        "mismatch" otherwise. A mismatch (forged params: other blocks, or other hashes, than the lease's) leaves the
        lease to its rightful reader."""
        with self._lock:
            lease = self._live(lease_id)
            if lease is None:
                return "expired"
            try:
                ok = all(0 <= int(i) < len(lease.block_ids) and lease.block_ids[int(i)] == int(b)
                         and lease.block_hashes[int(i)] == h for i, b, h in blocks)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                return "mismatch"
            lease.state = "done"
            return "valid"

    def reap(self) -> set[str]:
        """Request ids whose blocks may be freed now (lease done or expired); each is returned once."""
        now, freed = time.monotonic(), set()
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.state == "active" and now > lease.expires:
                    lease.state = "expired"
                    self.num_expired += 1
                    logger.warning("nixl: lease of request %s expired; freeing its %d blocks",
                                   lease.request_id, len(lease.block_ids))
                if lease.state != "active":
                    freed.add(lease.request_id)
                    del self._leases[lease_id]   # a late reader's heartbeat/done now answers "not valid"
        return freed

    def __len__(self) -> int:
        return len(self._leases)
