"""Connectors backed by a key-value block store (disk, Redis): a shared prefix cache and a P/D handoff medium.

Blocks are stored under their chained block hash (namespaced by the cache fingerprint, so engines with different
models or dtypes sharing one store never see each other's blocks) as :mod:`block_codec` records.

* Saving and the prefill handoff: :mod:`store_saving` (the handoff's write runs on the connector's handoff thread;
  the engine holds the response until it is done or ``handoff_timeout_s`` passes).
* The engine thread never waits on the store unbounded: the admission lookup runs on an I/O thread and is waited for
  at most ``lookup_timeout_s``, so a hung disk or an unanswered socket is a store failure, not a stalled engine.
* Loading: records are fetched in pipelined chunks (the next chunk in flight while one is verified) or, for disk, read
  by parallel threads straight into their cache blocks and verified there (one copy, the checksum on bytes still in
  the CPU cache); a chunk the store fails to return fails its blocks and the rest, the verified prefix stays. A
  request carrying ``do_remote_prefill`` params with ``block_hashes`` claims every listed block that
  matches its own prompt (a missing one is then a load error the engine recovers from); any other request claims the
  run of consecutive blocks the store holds beyond its local prefix hits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Iterator
from typing import Any

import torch

from pdserve.kv_connectors import block_codec
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec
from pdserve.kv_connectors.block_store import BlockStore
from pdserve.kv_connectors.load_errors import (CorruptBlock, FingerprintMismatch, KVLoadError, LoadTimeout,
                                               MissingBlock, logger)
from pdserve.kv_connectors.loading import LoadJob
from pdserve.kv_connectors.store_saving import StoreSaving


class StoreConnector(StoreSaving):
    """Config (besides the store's own): ``save`` (default true), ``load`` (default true), ``retry_after_s`` (5),
    ``fetch_chunk`` (32: records per round trip, the next chunk fetched while one is verified), ``read_threads`` (4:
    parallel block reads of stores with single-copy reads, i.e. disk),
    ``handoff_timeout_s`` (30, how long a prefill handoff's write may hold back its response), ``lookup_timeout_s``
    (2, the admission lookup), ``params_ttl_s`` (120, how long signed handoff params stay valid),
    ``max_pending_save_bytes`` (256 MiB: block snapshots queued for the background writer
    beyond this are skipped and counted as ``kv_saves_skipped``, so a slow store cannot grow memory without bound)."""

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        super().__init__(role, config, spec)
        self.store = self._make_store(config)
        self.load_enabled = bool(config.get("load", True))
        self.lookup_timeout_s = float(config.get("lookup_timeout_s", 2.0))
        self._tls = threading.local()
        self._cache_bytes: memoryview | None = None
        self._block_bytes = spec.block_bytes   # read per block (the spec's property builds a tensor per call)
        self.fetch_chunk = max(1, int(config.get("fetch_chunk", 32)))
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{self.name}-fetch")
        self._io = ThreadPoolExecutor(2, thread_name_prefix=f"pdserve-{self.name}-io")   # the engine thread's calls
        self.read_threads = max(1, int(config.get("read_threads", 4)))
        self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix=f"pdserve-{self.name}-read")

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
            found = self._bounded(self._io.submit(self.store.contains_many, hashes[start:]), self.lookup_timeout_s)
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
            # Blocks read in parallel (``read_threads``), no lock held during IO. On a CPU cache each record is read
            # straight into its cache block and verified there (the job is ``in_place``: past its deadline it is
            # reported only when no read of it is in flight, so the engine holds the blocks until then); a block that
            # fails verification is reported and recomputed, never used. Other caches: a staging buffer, verified,
            # then copied in under the lock.
            todo, read = iter(job.blocks), []   # each reader takes the next block (a list iterator is thread-safe)
            futures = [self._readers.submit(self._read_blocks, job, todo, read, errors)
                       for _ in range(self.read_threads)]
            wait(futures)   # every read has ended before the load is reported (the readers never raise)
            unread = {b for _, b, _ in job.blocks} - set(read) - set(errors)   # readers cancelled at shutdown
            errors.update({b: LoadTimeout("not read: the connector shut down") for b in unread})
            return self._after_load(job, errors)
        # Chunks of ``fetch_chunk`` records, the next one fetched (one pipelined round trip) while this one is verified
        # and copied in: the store's latency and the checksums overlap.
        chunks = [job.blocks[i:i + self.fetch_chunk] for i in range(0, len(job.blocks), self.fetch_chunk)]
        ahead = self._fetcher.submit(self.store.get_many, [h for _, _, h in chunks[0]])
        for k, chunk in enumerate(chunks):
            try:
                records = self._bounded(ahead, self.load_timeout_s)
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

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        super().register_kv_caches(kv_cache)
        # The whole CPU cache as bytes: block b is one slice (no per-block tensor views on the load path).
        self._cache_bytes = (block_codec.tensor_bytes(kv_cache)
                             if kv_cache.device.type == "cpu" and kv_cache.is_contiguous() else None)

    def _loads_in_place(self) -> bool:
        return self.store.direct and self._cache_bytes is not None

    def _read_blocks(self, job: LoadJob, todo: Iterator[tuple[int, int, bytes]], read: list[int],
                     errors: dict[int, KVLoadError]) -> None:
        for _, block_id, h in todo:
            try:
                self._read_direct(job, block_id, h)
                read.append(block_id)
            except KVLoadError as e:
                errors[block_id] = e
            except Exception as e:  # a bug or an unexpected library error fails its block, not the other reads
                logger.exception("%s: reading block %d of request %s crashed", self.name, block_id, job.request_id)
                errors[block_id] = KVLoadError(repr(e))

    def _read_direct(self, job: LoadJob, block_id: int, h: bytes) -> None:
        if job.cancelled:
            raise LoadTimeout("load cancelled after its deadline")
        if job.in_place:   # into the block itself, verified there (the block is the job's until it is reported)
            bb = self._block_bytes
            dest = self._cache_bytes[block_id * bb:(block_id + 1) * bb]
            self._start_read(job)
            try:
                block_codec.verify(self.store.read_into(h, dest), dest, self.fingerprint, h, self.dtype,
                                   self.block_shape)
            finally:
                self._end_read(job)
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
            return
        staging = getattr(self._tls, "staging", None)
        if staging is None or len(staging) != self._block_bytes:
            staging = self._tls.staging = memoryview(bytearray(self._block_bytes))
        header = self.store.read_into(h, staging)
        block_codec.verify(header, staging, self.fingerprint, h, self.dtype, self.block_shape)
        self._write_block(job, block_id, staging)

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

    @staticmethod
    def _bounded(fut: Future, timeout: float) -> Any:
        """The result of a store call running on the I/O thread, waited for at most ``timeout`` (then LoadTimeout:
        the call goes on in the background, its result unused)."""
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise LoadTimeout(f"store call did not return within {timeout:.1f}s") from None

    def shutdown(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        super().shutdown()   # queued saves first (bounded)
        self.store.close()
