"""Connectors backed by a key-value block store (disk, Redis): a shared prefix cache and a P/D handoff medium.

Blocks are stored under their chained block hash (namespaced by the cache fingerprint, so engines with different
models or dtypes sharing one store never see each other's blocks) as :mod:`block_codec` records.

* Saving: the prompt's full blocks are snapshotted (one gather copy) as soon as the engine reports them computed
  (``request_scheduled_for_save``) or at the latest when the request finishes, and written by a background thread
  (a handoff's blocks on CPU without the snapshot: its ``request_finished`` waits for those writes, and should that
  wait time out, keeps the blocks allocated (delay_free) until the writer is done with them).
  A prefill request with ``do_remote_decode`` is written synchronously before its ``kv_transfer_params`` are returned,
  so the decode side finds every block. A store that fails is skipped for ``retry_after_s`` (counted, never fatal).
* Loading: records are fetched in pipelined chunks (the next chunk in flight while one is verified) or, for disk, read
  by parallel threads; a chunk the store fails to return fails its blocks and the rest, the verified prefix stays. A
  request carrying ``do_remote_prefill`` params with ``block_hashes`` claims every listed block that
  matches its own prompt (a missing one is then a load error the engine recovers from); any other request claims the
  run of consecutive blocks the store holds beyond its local prefix hits.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pdserve.kv_connectors import block_codec, kv_auth
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec
from pdserve.kv_connectors.load_errors import (CorruptBlock, FingerprintMismatch, KVLoadError, LoadTimeout,
                                               MissingBlock, logger)
from pdserve.kv_connectors.loading import LoadingConnector, LoadJob


class BlockStore(ABC):
    """Bytes under block hashes. Implementations bound every call with a timeout."""

    @abstractmethod
    def put_many(self, items: list[tuple[bytes, bytes, memoryview]]) -> None:
        """Store (block hash, header, payload) records."""

    @abstractmethod
    def get_many(self, hashes: list[bytes]) -> list[bytes | memoryview | None]:
        """The stored records (None where absent). Raises KVLoadError when the store itself fails."""

    @abstractmethod
    def contains_many(self, hashes: list[bytes]) -> list[bool]:
        ...

    def read_into(self, block_hash: bytes, dest: memoryview) -> block_codec.Header:
        """Optional single-copy read: the payload straight into ``dest``, returning the parsed (unverified) header.
        Raises MissingBlock / TruncatedBlock / CorruptBlock."""
        raise NotImplementedError

    direct = False   # True when read_into is implemented

    @abstractmethod
    def delete_many(self, hashes: list[bytes]) -> None:
        """Remove records (absent ones are fine)."""

    def close(self) -> None:
        pass


class StoreConnector(LoadingConnector):
    """Config (besides the store's own): ``save`` (default true), ``load`` (default true), ``retry_after_s`` (5),
    ``fetch_chunk`` (32: records per round trip, the next chunk fetched while one is verified), ``read_threads`` (4:
    parallel block reads of stores with single-copy reads, i.e. disk),
    ``handoff_timeout_s`` (30, the synchronous save of a prefill handoff), ``params_ttl_s`` (120, how long signed
    handoff params stay valid), ``max_pending_save_bytes`` (256 MiB: block snapshots queued for the background writer
    beyond this are skipped and counted as ``kv_saves_skipped``, so a slow store cannot grow memory without bound)."""

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        super().__init__(role, config, spec)
        self.store = self._make_store(config)
        self.save_enabled = bool(config.get("save", True))
        self.load_enabled = bool(config.get("load", True))
        self.retry_after_s = float(config.get("retry_after_s", 5.0))
        self.handoff_timeout_s = float(config.get("handoff_timeout_s", 30.0))
        self.engine_id = str(config.get("engine_id") or uuid.uuid4())
        self._saved_upto: dict[str, int] = {}
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes this process saved recently
        self._known_cap = 65536
        self._store_down_until = 0.0
        self.params_ttl_s = float(config.get("params_ttl_s", 120.0))
        self.max_pending_save_bytes = int(config.get("max_pending_save_bytes", 256 << 20))
        self._pending_save_bytes = 0   # snapshots queued for (or being written by) the writer thread
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{self.name}-save")
        self._known_lock = threading.Lock()
        self._tls = threading.local()
        self._live_writes: dict[str, int] = {}    # request id -> queued writes reading its live (unsnapshotted) blocks
        self._held_for_writes: set[str] = set()   # finished requests whose blocks wait for those writes (delay_free)
        self.fetch_chunk = max(1, int(config.get("fetch_chunk", 32)))
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{self.name}-fetch")
        self._readers = ThreadPoolExecutor(max(1, int(config.get("read_threads", 4))),
                                           thread_name_prefix=f"pdserve-{self.name}-read")

    def _make_store(self, config: dict[str, Any]) -> BlockStore:
        raise NotImplementedError

    # ---- loading -------------------------------------------------------------------------------------------------
    def _num_loadable(self, request: ConnectorRequest, start: int, hashes: list[bytes],
                      params: dict[str, Any] | None) -> int:
        if not self.load_enabled:
            return 0
        remote = (params or {}).get("block_hashes")
        if remote is not None:
            n = 0
            while start + n < min(len(hashes), len(remote)) and remote[start + n] == hashes[start + n].hex():
                n += 1
            return n
        if time.monotonic() < self._store_down_until:
            return 0
        try:
            found = self.store.contains_many(hashes[start:])
        except KVLoadError as e:
            self._mark_down(e, "lookup")
            return 0
        return found.index(False) if False in found else len(found)

    def _load(self, job: LoadJob) -> dict[int, KVLoadError]:
        params = job.params or {}
        if params.get("do_remote_prefill") and params.get("fingerprint") not in (None, self.fingerprint):
            raise FingerprintMismatch(f"prefill fingerprint {params['fingerprint']} != ours {self.fingerprint}")
        errors: dict[int, KVLoadError] = {}
        if self.store.direct:
            # Blocks read in parallel (``read_threads``), each into its thread's staging buffer (no lock held during
            # IO, so a stuck disk cannot stall the engine and the watchdog can always cancel), verified, then copied
            # into the cache under the lock.
            for block_id, e in self._readers.map(lambda blk: self._read_direct(job, blk[1], blk[2]), job.blocks):
                if e is not None:
                    errors[block_id] = e
            return self._after_load(job, errors)
        # Chunks of ``fetch_chunk`` records, the next one fetched (one pipelined round trip) while this one is verified
        # and copied in: the store's latency and the checksums overlap.
        chunks = [job.blocks[i:i + self.fetch_chunk] for i in range(0, len(job.blocks), self.fetch_chunk)]
        ahead = self._fetcher.submit(self.store.get_many, [h for _, _, h in chunks[0]])
        for k, chunk in enumerate(chunks):
            try:
                records = ahead.result()
            except KVLoadError as e:   # the store failed mid-transfer: the verified prefix stays, the rest fails
                errors.update({b: e for rest in chunks[k:] for _, b, _ in rest})
                break
            if k + 1 < len(chunks) and not job.cancelled:
                ahead = self._fetcher.submit(self.store.get_many, [h for _, _, h in chunks[k + 1]])
            for (_, block_id, h), data in zip(chunk, records):
                try:
                    if data is None:
                        raise MissingBlock(f"block {h.hex()[:16]} is not in the store")
                    header = block_codec.parse_header(data)
                    payload = memoryview(data)[block_codec.HEADER_SIZE:]
                    block_codec.verify(header, payload, self.fingerprint, h, self.dtype, self.block_shape)
                    self._write_block(job, block_id, payload)
                except KVLoadError as e:
                    errors[block_id] = e
            if job.cancelled:
                break
        return self._after_load(job, errors)

    def _read_direct(self, job: LoadJob, block_id: int, h: bytes) -> tuple[int, KVLoadError | None]:
        staging = getattr(self._tls, "staging", None)
        if staging is None or len(staging) != self.spec.block_bytes:
            staging = self._tls.staging = memoryview(bytearray(self.spec.block_bytes))
        try:
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
            header = self.store.read_into(h, staging)
            block_codec.verify(header, staging, self.fingerprint, h, self.dtype, self.block_shape)
            self._write_block(job, block_id, staging)
        except KVLoadError as e:
            return block_id, e
        return block_id, None

    def _after_load(self, job: LoadJob, errors: dict[int, KVLoadError]) -> dict[int, KVLoadError]:
        self._remember([h for _, b, h in job.blocks if b not in errors])   # in the store already: never re-save
        # A damaged record would fail every reader until it expires, and a handoff would not rewrite it (it is
        # "present"): delete it, so the next save of that block replaces it.
        bad = [h for _, b, h in job.blocks if isinstance(errors.get(b), CorruptBlock)]
        if bad:
            with self._known_lock:
                for h in bad:
                    self._known.pop(h, None)
            try:
                self.store.delete_many(bad)
                self.stats.add("kv_corrupt_blocks_deleted", len(bad))
            except KVLoadError as e:
                logger.warning("%s: could not delete %d damaged blocks: %s", self.name, len(bad), e)
        return errors

    # ---- saving --------------------------------------------------------------------------------------------------
    def request_scheduled_for_save(self, request: ConnectorRequest, block_ids: list[int], num_computed_tokens: int) -> None:
        n = min(num_computed_tokens // self.spec.block_size, len(request.block_hashes), len(block_ids))
        self._save_range(request, block_ids, n, sync=False)

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        handoff = bool(params.get("do_remote_decode"))
        n = min(len(request.block_hashes), len(block_ids))
        if handoff:  # the decode side must find every block: let queued writes land, then write what is missing
            try:
                self.flush(self.handoff_timeout_s)
            except Exception as e:  # a stuck writer: the decode side then reports missing blocks and recovers
                logger.warning("%s: queued saves not done for %s: %r", self.name, request.request_id, e)
            self._saved_upto.pop(request.request_id, None)
            self._save_range(request, block_ids, n, sync=True, force=True)
        else:
            self._save_range(request, block_ids, n, sync=False)
        self._saved_upto.pop(request.request_id, None)
        if not handoff:
            return False, None
        with self._known_lock:   # a stuck writer still reading the live blocks: keep them until it is done
            hold = request.request_id in self._live_writes
            if hold:
                self._held_for_writes.add(request.request_id)
        return hold, kv_auth.sign_params({
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_block_ids": list(block_ids[:n]), "remote_request_id": request.request_id,
            "remote_host": None, "remote_port": None, "tp_size": 1, "connector": self.name,
            "fingerprint": self.fingerprint, "block_hashes": [h.hex() for h in request.block_hashes[:n]],
            **kv_auth.lora_identity(request),
        }, self.secret, self.params_ttl_s)

    def _save_range(self, request: ConnectorRequest, block_ids: list[int], upto: int, *, sync: bool,
                    force: bool = False) -> None:
        start = self._saved_upto.get(request.request_id, 0)
        self._saved_upto[request.request_id] = max(start, upto)
        if not self.save_enabled or upto <= start or self.kv_cache is None:
            return
        hashes = request.block_hashes
        with self._known_lock:
            todo = [(hashes[i], block_ids[i]) for i in range(start, upto) if force or hashes[i] not in self._known]
        if force and todo:
            try:
                present = self.store.contains_many([h for h, _ in todo])
                todo = [t for t, p in zip(todo, present) if not p]
            except KVLoadError as e:
                self._mark_down(e, "save")
                return
        if not todo:
            return
        if not force and time.monotonic() < self._store_down_until:
            self.stats.add("kv_saves_skipped", len(todo))
            return
        if self.kv_cache.device.type == "cpu" and (sync or (request.kv_transfer_params or {}).get("do_remote_decode")):
            # Written before the blocks can be freed, so the live blocks will do (no snapshot copy): a sync write
            # returns first, and a handoff's request_finished waits for its queued writes (flush) before returning.
            live = [self.kv_cache[b] for _, b in todo]
            if sync:
                self._write(request.request_id, [h for h, _ in todo], live)
            else:
                with self._known_lock:
                    self._live_writes[request.request_id] = self._live_writes.get(request.request_id, 0) + 1
                self._writer.submit(self._live_write, request.request_id, [h for h, _ in todo], live)
            return
        nbytes = len(todo) * self.spec.block_bytes
        if not sync:
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
        if sync:
            self._write(request.request_id, [h for h, _ in todo], list(snap))
        else:
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
                with self._lock:
                    self._sending_done.add(request_id)

    def _queued_write(self, nbytes: int, request_id: str, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
        try:
            self._write(request_id, hashes, blocks)
        finally:
            with self._known_lock:
                self._pending_save_bytes -= nbytes

    def _write(self, request_id: str, hashes: list[bytes], blocks: list[torch.Tensor]) -> None:
        items = []
        for h, block in zip(hashes, blocks):
            payload = block_codec.tensor_bytes(block)
            items.append((h, block_codec.encode_header(block, self.fingerprint, h, payload), payload))
        try:
            self.store.put_many(items)
        except KVLoadError as e:
            self.stats.add("kv_saves_skipped", len(items))
            self._mark_down(e, f"save of request {request_id}")
            return
        self._remember(hashes)
        self.stats.add("kv_blocks_saved", len(items))
        self.stats.add("kv_bytes_saved", len(items) * self.spec.block_bytes)

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
        """Wait until every queued save is written (tests, graceful shutdown)."""
        self._writer.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
        self.store.close()
