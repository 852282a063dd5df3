"""Which KV blocks each pod holds: block hash -> pods, fed by the pods' KV events plus speculative entries.

Contract:
- ``apply(pod, batch)`` applies one decoded ``KVEventBatch`` from ``pod`` (BlockStored adds, BlockRemoved drops,
  AllBlocksCleared forgets the pod). Hashes are the shared 32-byte digests of ``pdserve.runtime.block_hash``.
- ``add_speculative(pod, hashes)`` records that the router just sent a request with these blocks to ``pod``: they
  count as cached there for ``ttl`` seconds, bridging the gap until the pod's own BlockStored events arrive.
- ``match(hashes, pods)`` returns, per pod, the length of the longest *consecutive* run of ``hashes`` from the first
  block that the pod holds (real or unexpired speculative), weighted by medium (GPU 1.0, CPU-tier lower).
- ``match_history(hashes, pods)``: the same over the router's routing history (the pod each block was last sent
  to, bounded memory, no expiry). It outlives evictions on purpose: sending a tenant back to where it was last
  routed re-warms one pod instead of migrating the prefix and evicting someone else's (stickiness under pressure).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Callable

from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# Credit for a block found in a slower tier (llm-d: CPU 0.8; Dynamo: host 0.75, disk 0.25).
MEDIUM_WEIGHT = {"GPU": 1.0, None: 1.0, "CPU": 0.8, "CPU_TIER": 0.8, "DISK": 0.25}


class PrefixIndex:
    def __init__(self, ttl: float = 2.0, clock: Callable[[], float] = time.monotonic, history_size: int = 1 << 18):
        self.ttl = ttl
        self.clock = clock
        self.history_size = history_size
        self._history: dict[bytes, str] = {}                    # hash -> pod it was last routed to
        self._blocks: dict[bytes, dict[str, float]] = {}       # hash -> {pod: weight}
        self._by_pod: dict[str, set[bytes]] = {}                # pod -> hashes (for forget/clear)
        self._spec: dict[bytes, dict[str, float]] = {}          # hash -> {pod: expiry}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, pod: str, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.store(pod, ev.block_hashes, MEDIUM_WEIGHT.get(ev.medium, 0.8))
            elif isinstance(ev, BlockRemoved):
                self.remove(pod, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.forget_pod(pod)

    def store(self, pod: str, hashes: Iterable[bytes], weight: float = 1.0) -> None:
        owned = self._by_pod.setdefault(pod, set())
        for h in hashes:
            pods = self._blocks.setdefault(h, {})
            pods[pod] = max(weight, pods.get(pod, 0.0))
            owned.add(h)

    def remove(self, pod: str, hashes: Iterable[bytes]) -> None:
        owned = self._by_pod.get(pod)
        for h in hashes:
            pods = self._blocks.get(h)
            if pods is not None and pods.pop(pod, None) is not None and not pods:
                del self._blocks[h]
            if owned is not None:
                owned.discard(h)

    def forget_pod(self, pod: str) -> None:
        """Drop everything known about ``pod`` (its cache was cleared, it restarted, or it left)."""
        self.remove(pod, list(self._by_pod.pop(pod, ())))
        for h in [h for h, pods in self._spec.items() if pod in pods]:
            self._drop_spec(h, pod)

    def forget_history(self, pod: str) -> None:
        """The pod left: its routing history means nothing any more."""
        for h in [h for h, p in self._history.items() if p == pod]:
            del self._history[h]

    def add_speculative(self, pod: str, hashes: Sequence[bytes]) -> None:
        """Record a routing decision: speculative entries (``ttl``) and the routing history."""
        expiry = self.clock() + self.ttl
        if len(self._history) + len(hashes) > self.history_size:
            self._history.clear()  # crude bound; hot prefixes are re-learned on their next request
        for h in hashes:
            self._spec.setdefault(h, {})[pod] = expiry
            self._history[h] = pod

    def match_history(self, hashes: Sequence[bytes], pods: Iterable[str]) -> dict[str, int]:
        """Per pod, the leading consecutive blocks of ``hashes`` last routed to it."""
        result = {p: 0 for p in pods}
        if not hashes:
            return result
        first = self._history.get(hashes[0])
        if first not in result:
            return result
        n = 0
        for h in hashes:
            if self._history.get(h) != first:
                break
            n += 1
        result[first] = n
        return result

    def purge_expired(self) -> None:
        now = self.clock()
        for h, pods in list(self._spec.items()):
            for pod in [p for p, exp in pods.items() if exp <= now]:
                self._drop_spec(h, pod)

    def match(self, hashes: Sequence[bytes], pods: Iterable[str]) -> dict[str, float]:
        """Weighted number of leading consecutive blocks of ``hashes`` held by each of ``pods``."""
        now = self.clock()
        result = {p: 0.0 for p in pods}
        alive = set(result)
        for h in hashes:
            real = self._blocks.get(h)
            spec = self._spec.get(h)
            still = set()
            for p in alive:
                w = real.get(p, 0.0) if real else 0.0
                if spec and spec.get(p, 0.0) > now:
                    w = 1.0
                if w > 0.0:
                    result[p] += w
                    still.add(p)
            alive = still
            if not alive:
                break
        return result

    def _drop_spec(self, h: bytes, pod: str) -> None:
        pods = self._spec.get(h)
        if pods is not None:
            pods.pop(pod, None)
            if not pods:
                del self._spec[h]
