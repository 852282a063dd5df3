"""The saving half of a store connector (disk, Redis): queued saves of computed blocks, and the prefill handoff.

* Saving: the prompt's full blocks are snapshotted (one gather copy) as soon as the engine reports them computed
  (``request_scheduled_for_save``) or at the latest when the request finishes, and written by a background writer
  thread (with helpers where the store takes concurrent puts, ``BlockStore.put_threads``: each hashes and writes a
  share of a long save). A handoff's blocks on CPU are written without the snapshot (live): they stay allocated until
  every write reading them has ended (``_live_writes``). Snapshots queued beyond ``max_pending_save_bytes`` are
  dropped and counted, so a slow store cannot grow memory without bound. A store that fails is skipped for
  ``retry_after_s`` (counted, never fatal).
* Handoff (a prefill request with ``do_remote_decode``): the decode side must find every block, so on the handoff
  thread (:mod:`handoff`) the queued writes are let land, then what the store lacks is written; the response's signed
  params are released when that is done, or at ``handoff_timeout_s`` (then the decode side reports the missing
  blocks and recomputes them). The engine thread never waits on it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from pdserve.kv_connectors import block_codec, kv_auth
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec
from pdserve.kv_connectors.block_store import BlockStore
from pdserve.kv_connectors.load_errors import KVLoadError, LoadTimeout, logger
from pdserve.kv_connectors.loading import LoadingConnector


class StoreSaving(LoadingConnector):
    """Config: ``save`` (true), ``retry_after_s`` (5), ``handoff_timeout_s`` (30), ``params_ttl_s`` (120),
    ``max_pending_save_bytes`` (256 MiB), ``engine_id``. Subclasses set ``self.store``."""

    store: BlockStore

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        super().__init__(role, config, spec)
        self.save_enabled = bool(config.get("save", True))
        self.retry_after_s = float(config.get("retry_after_s", 5.0))
        self.handoff_timeout_s = float(config.get("handoff_timeout_s", 30.0))
        self.engine_id = str(config.get("engine_id") or uuid.uuid4())
        self.params_ttl_s = float(config.get("params_ttl_s", 120.0))
        self.max_pending_save_bytes = int(config.get("max_pending_save_bytes", 256 << 20))
        self._saved_upto: dict[str, int] = {}
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes this process saved (or loaded) recently
        self._known_cap = 65536
        self._known_lock = threading.Lock()
        self._store_down_until = 0.0
        self._pending_save_bytes = 0   # snapshots queued for (or being written by) the writer thread
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{self.name}-save")
        # the writer's (and the handoff thread's) helpers for stores with put_threads > 1; threads start on first use
        self._put_pool = ThreadPoolExecutor(4, thread_name_prefix=f"pdserve-{self.name}-put")
        self._live_writes: dict[str, int] = {}    # request id -> queued writes reading its live (unsnapshotted) blocks
        self._held_for_writes: set[str] = set()   # finished requests whose blocks wait for those writes (delay_free)

    # ---- saving --------------------------------------------------------------------------------------------------
    def request_scheduled_for_save(self, request: ConnectorRequest, block_ids: list[int], num_computed_tokens: int) -> None:
        n = min(num_computed_tokens // self.spec.block_size, len(request.block_hashes), len(block_ids))
        self._save_range(request, block_ids, n)

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None, bool]:
        rid, n = request.request_id, min(len(request.block_hashes), len(block_ids))
        computed = getattr(request, "num_computed_tokens", None)
        if computed is not None:   # an engine request: never save blocks it did not compute or load (an abort
            n = min(n, computed // self.spec.block_size)   # mid-load leaves unverified bytes in the rest)
        if not (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._save_range(request, block_ids, n)
            self._saved_upto.pop(rid, None)
            return False, None, False
        self._saved_upto.pop(rid, None)
        params = kv_auth.sign_params({
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_block_ids": list(block_ids[:n]), "remote_request_id": rid,
            "remote_host": None, "remote_port": None, "tp_size": 1, "connector": self.name,
            "fingerprint": self.fingerprint, "block_hashes": [h.hex() for h in request.block_hashes[:n]],
            **kv_auth.lora_identity(request),
        }, self.secret, self.params_ttl_s)
        if not self.save_enabled or self.kv_cache is None or n == 0:
            return self._hold_for_writes(rid), params, False

        def overdue() -> dict:   # the decode side then reports the missing blocks and recomputes them
            self.stats.add("kv_saves_skipped", n)
            self._mark_down(LoadTimeout(f"not written within {self.handoff_timeout_s:.1f}s"), f"handoff of {rid}")
            return params

        # The decode side must find every block: on the handoff thread, let queued writes land, then write what the
        # store lacks, reading the live blocks (held, delay_free, until that work has really ended).
        deadline = time.monotonic() + self.handoff_timeout_s
        hashes, ids = list(request.block_hashes[:n]), list(block_ids[:n])
        self.handoffs.start(rid, self.handoff_timeout_s, lambda: self._handoff_write(rid, hashes, ids, deadline),
                            lambda _: params, overdue, lambda _: self._hold_for_writes(rid) or self._freed(rid))
        return True, None, True

    def _handoff_write(self, request_id: str, hashes: list[bytes], block_ids: list[int], deadline: float) -> None:
        try:
            self._writer.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
        except FutureTimeout:   # a stuck writer: write what is missing anyway
            logger.warning("%s: queued saves not done for %s", self.name, request_id)
        try:
            present = self.store.contains_many(hashes)
        except KVLoadError as e:
            self._mark_down(e, "save")
            return
        todo = [(h, b) for h, b, p in zip(hashes, block_ids, present) if not p]
        if todo:   # the live blocks (held until this ends); on a GPU one gather copy to host
            ids = [b for _, b in todo]
            blocks = ([self.kv_cache[b] for b in ids] if self.kv_cache.device.type == "cpu"
                      else list(self.kv_cache[torch.tensor(ids, device=self.kv_cache.device)].cpu()))
            self._write(request_id, [h for h, _ in todo], blocks)

    def _hold_for_writes(self, request_id: str) -> bool:
        """Keep a finished handoff's blocks while a queued write still reads them live; True if so."""
        with self._known_lock:
            hold = request_id in self._live_writes
            if hold:
                self._held_for_writes.add(request_id)
        return hold

    def _save_range(self, request: ConnectorRequest, block_ids: list[int], upto: int) -> None:
        """Queue blocks ``[saved so far, upto)`` for the writer: a handoff's live blocks on CPU (its blocks are held
        until those writes end: ``_live_writes``), anything else as a snapshot."""
        start = self._saved_upto.get(request.request_id, 0)
        self._saved_upto[request.request_id] = max(start, upto)
        if not self.save_enabled or upto <= start or self.kv_cache is None:
            return
        hashes = request.block_hashes
        with self._known_lock:
            todo = [(hashes[i], block_ids[i]) for i in range(start, upto) if hashes[i] not in self._known]
        if not todo:
            return
        if time.monotonic() < self._store_down_until:
            self.stats.add("kv_saves_skipped", len(todo))
            return
        if self.kv_cache.device.type == "cpu" and (request.kv_transfer_params or {}).get("do_remote_decode"):
            live = [self.kv_cache[b] for _, b in todo]
            with self._known_lock:
                self._live_writes[request.request_id] = self._live_writes.get(request.request_id, 0) + 1
            self._writer.submit(self._live_write, request.request_id, [h for h, _ in todo], live)
            return
        nbytes = len(todo) * self.spec.block_bytes
        with self._known_lock:
            full = self._pending_save_bytes > 0 and self._pending_save_bytes + nbytes > self.max_pending_save_bytes
            if not full:
                self._pending_save_bytes += nbytes
        if full:   # the writer is behind (slow store): drop these saves rather than queue memory without bound
            self.stats.add("kv_saves_skipped", len(todo))
            self.stats.add("kv_saves_dropped_queue_full", len(todo))
            return
        # One gather copy: the snapshot stays valid even if the engine reuses the blocks before the write.
        snap = self.kv_cache[torch.tensor([b for _, b in todo])].cpu()
        self._writer.submit(self._queued_write, nbytes, request.request_id, [h for h, _ in todo], list(snap))

    def _live_write(self, request_id: str, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
        try:
            self._write(request_id, hashes, blocks)
        finally:
            with self._known_lock:
                left = self._live_writes.pop(request_id) - 1
                if left:
                    self._live_writes[request_id] = left
                release = not left and request_id in self._held_for_writes
                self._held_for_writes.discard(request_id)
            if release:   # the request finished while this write read its blocks: they may be freed now
                self._freed(request_id)

    def _queued_write(self, nbytes: int, request_id: str, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
        try:
            self._write(request_id, hashes, blocks)
        finally:
            with self._known_lock:
                self._pending_save_bytes -= nbytes

    def _write(self, request_id: str, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
        """Checksum and store the blocks. Where the store takes concurrent puts (``put_threads``), in that many shares
        on the put threads, each hashing and writing its own blocks: the hashing of one share overlaps the writes of
        the others, and the writes (copies into the page cache) run side by side."""
        pairs = list(zip(hashes, blocks))
        n = min(self.store.put_threads, len(pairs) // 8)   # shares of 8 blocks or more
        if n > 1:
            step = -(-len(pairs) // n)
            results = list(self._put_pool.map(self._put, [pairs[i:i + step] for i in range(0, len(pairs), step)]))
        else:
            results = [self._put(pairs)]
        saved = [h for done, _ in results for h in done]
        if len(saved) < len(pairs):   # a failed share: its blocks are not remembered as saved
            self.stats.add("kv_saves_skipped", len(pairs) - len(saved))
            self._mark_down(next(e for _, e in results if e is not None), f"save of request {request_id}")
        self._remember(saved)
        self.stats.add("kv_blocks_saved", len(saved))
        self.stats.add("kv_bytes_saved", len(saved) * self.spec.block_bytes)

    def _put(self, pairs: list[tuple[bytes, torch.Tensor]]) -> tuple[list[bytes], KVLoadError | None]:
        """One share of :meth:`_write`: (the hashes stored, or none and the store's error)."""
        items = []
        for h, block in pairs:
            payload = block_codec.tensor_bytes(block)
            items.append((h, block_codec.encode_header(block, self.fingerprint, h, payload), payload))
        try:
            self.store.put_many(items)
        except KVLoadError as e:
            return [], e
        return [h for h, _ in pairs], None

    def _remember(self, hashes: list[bytes]) -> None:
        with self._known_lock:
            for h in hashes:
                self._known[h] = None
                self._known.move_to_end(h)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    def _mark_down(self, error: Exception, what: str) -> None:
        self._store_down_until = time.monotonic() + self.retry_after_s
        self.stats.add("kv_store_errors")
        logger.warning("%s: %s failed (%s); skipping the store for %.0fs", self.name, what, error, self.retry_after_s)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued save and handoff write is done (tests, graceful shutdown)."""
        end = time.monotonic() + timeout
        self._writer.submit(lambda: None).result(timeout)
        self.handoffs.flush(max(0.0, end - time.monotonic()))

    def shutdown(self) -> None:
        try:   # let queued saves land, but a hung store must not hang the shutdown
            self.flush(self.handoff_timeout_s)
        except Exception as e:  # noqa: BLE001
            logger.warning("%s: queued saves not written at shutdown: %r", self.name, e)
        self._writer.shutdown(wait=False)
        self._put_pool.shutdown(wait=False)
        super().shutdown()
