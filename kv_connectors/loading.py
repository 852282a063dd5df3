"""The load bookkeeping every pdserve connector shares: claims, per-request load jobs, async loading, error reports.

Subclasses answer two questions and the rest follows the base contract:

* :meth:`LoadingConnector._num_loadable` - how many blocks from ``start`` on could be loaded for this request, given
  its *verified* ``kv_transfer_params`` (None unless they were signed by a prefill of this deployment: see
  :mod:`kv_auth`; unsigned, forged or expired params are dropped before any lookup, counted by reason);
* :meth:`LoadingConnector._load` - load a job's blocks into the registered cache (``_write_block``), returning the
  block ids that failed, each with its :class:`KVLoadError`.

Invariants: a claimed load is always reported finished (``get_finished()[1]`` for async loads), failed or not; every
failed block id is reported exactly once by ``get_block_ids_with_load_errors``; a job that overruns its deadline is
cancelled (no new block is read, late writes through ``_write_block`` are dropped) and reported as timed out; a request
that finishes while its load is in flight keeps its blocks (delay_free) until the load thread is done with them.
A job whose reads write straight into its cache blocks (``in_place``: no lock, no staging copy) counts the reads in
flight (``reads_in_flight``, under the lock); past its deadline it is reported only once none is: until then the
engine holds its blocks (WAITING_FOR_REMOTE_KVS, or parked if the request was aborted), so no late write can reach a
block with a new owner or a recomputed one.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_connectors import kv_auth
from pdserve.kv_connectors.block_codec import tensor_bytes
from pdserve.kv_connectors.base import ConnectorRequest, KVCacheSpec, KVConnectorBase, KVConnectorMetadata
from pdserve.kv_connectors.handoff import HandoffJobs
from pdserve.kv_connectors.load_errors import ConnectorStats, KVLoadError, LoadTimeout, logger


@dataclass
class LoadJob:
    request_id: str
    blocks: list[tuple[int, int, bytes]]       # (block_index in the request, block id, block hash)
    params: dict[str, Any] | None               # the request's verified kv_transfer_params (None: not trusted/none)
    is_async: bool
    deadline: float = 0.0
    cancelled: bool = False
    in_place: bool = False                      # its reads write the blocks directly (see the module docstring)
    reads_in_flight: int = 0                    # in-place reads writing its blocks now (changed under the lock)
    finished: bool = False                      # reported (by its thread, or by the watchdog unless in_place)
    started: float = 0.0                        # wall clock, when the load was started
    record: dict[str, Any] | None = None        # the request's ``kv_transfer`` dict, filled when the load ends


class LoadingConnector(KVConnectorBase):
    """Shared scheduler/worker bookkeeping for loads. Config: ``async_load`` (default true), ``load_timeout_s``."""

    name = "loading"
    verify_checksums = True   # every loaded block is checked against its checksum (NIXL: a config switch)

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        super().__init__(role, config, spec)
        self.stats = ConnectorStats(self.name)
        self.secret = kv_auth.require_secret(self.name, config)   # None only when explicitly insecure
        if self.secret is None:
            logger.warning("%s: running INSECURELY (no KV secret): kv_transfer_params are neither signed nor checked, "
                           "so any client can make this pod read KV from an address it names", self.name)
        for reason in kv_auth.REJECT_REASONS:
            self.stats.add(f"kv_params_rejected{{reason={reason}}}", 0)
        self._verdicts: dict[str, tuple[Any, dict[str, Any] | None]] = {}   # request id -> (its params, trusted or None)
        self.async_load = bool(config.get("async_load", True))
        self.load_timeout_s = float(config.get("load_timeout_s", 10.0))
        self.fingerprint = spec.fingerprint()
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        self.block_shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_cache: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[int, list[bytes], dict[str, Any] | None]] = {}
        self._allocated: dict[str, LoadJob] = {}
        self._scheduled: dict[str, LoadJob] = {}
        self._running: dict[str, LoadJob] = {}
        self._free_after_load: set[str] = set()
        self._recving_done: set[str] = set()
        self._sending_done: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._pool = ThreadPoolExecutor(int(config.get("load_threads", 2)), thread_name_prefix=f"pdserve-{self.name}")
        self.handoffs = HandoffJobs(self.name)

    # ---- subclass hooks ---------------------------------------------------------------------------------------------
    def _num_loadable(self, request: ConnectorRequest, start: int, hashes: list[bytes],
                      params: dict[str, Any] | None) -> int:
        """Consecutive blocks ``hashes[start:]`` that can be loaded (``hashes`` already excludes the last token);
        ``params``: the request's verified load-directing ``kv_transfer_params`` (None when it has none)."""
        raise NotImplementedError

    def _load(self, job: LoadJob) -> dict[int, KVLoadError]:
        """Load ``job.blocks`` into the cache; return {block_id: error} for the blocks that failed."""
        raise NotImplementedError

    def _loads_in_place(self) -> bool:
        """True when ``_load`` writes blocks outside ``_write_block`` (straight into the cache, unlocked), each read
        bracketed by ``_start_read`` / ``_end_read``: past its deadline the job is reported only when no read is in
        flight."""
        return False

    def _start_read(self, job: LoadJob) -> None:
        """An in-place read of one of ``job``'s blocks begins (raises LoadTimeout once the job is cancelled)."""
        with self._lock:
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
            job.reads_in_flight += 1

    def _end_read(self, job: LoadJob) -> None:
        with self._lock:
            job.reads_in_flight -= 1

    def _watchdog_s(self) -> float:
        """How long an async load may run before it is cancelled and reported timed out; longer than the sum of the
        load's own timeouts, so that it only catches a load stuck where no timeout applies."""
        return self.load_timeout_s * 2 + 1.0

    def _on_request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict | None, bool]:
        """(delay_free, params, pending) of a finished request no load still writes (see base.start_request_finished);
        a pending handoff is started on ``self.handoffs``."""
        return False, None, False

    def _trusted_params(self, request: ConnectorRequest) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params`` if they direct a load (``do_remote_prefill``) and carry a valid, unexpired
        signature of this deployment's secret; None otherwise. Decided once per request (and counted once)."""
        rid, p = request.request_id, request.kv_transfer_params
        seen = self._verdicts.get(rid)
        if seen is not None and seen[0] is p:
            return seen[1]
        if not (isinstance(p, dict) and p.get("do_remote_prefill")):
            return None
        reason = kv_auth.verify_params(p, self.secret) if self.secret is not None else None
        if reason is None and kv_auth.lora_mismatch(p, request):
            reason = "lora_mismatch"
        if reason is not None:
            self.stats.add(f"kv_params_rejected{{reason={reason}}}")
            logger.warning("%s: ignoring kv_transfer_params of request %s (%s): computing its prompt locally",
                           self.name, rid, reason)
        trusted = p if reason is None else None
        self._verdicts[rid] = (p, trusted)
        return trusted

    # ---- scheduler side -------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.spec.block_size
        self._claims.pop(request.request_id, None)
        if num_computed_tokens % bs:
            return 0, False
        # Every full prompt block the prefill published, the last one included (a block-aligned prompt then loads
        # whole; the engine recomputes only its final token for the logits, as vLLM does).
        hashes = list(request.block_hashes[: len(request.prompt_token_ids) // bs])
        start = num_computed_tokens // bs
        if start >= len(hashes):
            return 0, False
        params = self._trusted_params(request)
        try:
            n = min(self._num_loadable(request, start, hashes, params), len(hashes) - start)
        except Exception:   # a lookup that fails is a miss: the engine computes the prompt itself
            logger.exception("%s: lookup failed for request %s", self.name, request.request_id)
            n = 0
        if n <= 0:
            return 0, False
        self._claims[request.request_id] = (start, hashes[start:start + n], params)
        return n * bs, self.async_load

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        claim = self._claims.pop(request.request_id, None)
        if claim is None or num_external_tokens <= 0:
            return
        start, hashes, params = claim
        n = min(len(hashes), num_external_tokens // self.spec.block_size)
        blocks = [(start + i, block_ids[start + i], hashes[i]) for i in range(n)]
        self._allocated[request.request_id] = LoadJob(request.request_id, blocks, params, self.async_load,
                                                      record=getattr(request, "kv_transfer", None))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads={rid: [(i, b) for i, b, _ in job.blocks] for rid, job in self._allocated.items()})
        self._scheduled.update(self._allocated)
        self._allocated.clear()
        return meta

    def start_request_finished(self, request: ConnectorRequest,
                               block_ids: list[int]) -> tuple[bool, dict[str, Any] | None, bool]:
        rid = request.request_id
        self._claims.pop(rid, None)
        self._allocated.pop(rid, None)
        self._verdicts.pop(rid, None)
        with self._lock:
            if rid in self._running:   # the load thread may still write into these blocks: keep them until it is done
                self._free_after_load.add(rid)
                return True, None, False
        return self._on_request_finished(request, block_ids)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params, pending = self.start_request_finished(request, block_ids)
        return delay, self.handoffs.wait(request.request_id) if pending else params

    def get_finished_handoffs(self) -> dict[str, dict[str, Any]]:
        return self.handoffs.take_finished()

    def _freed(self, request_id: str) -> None:
        """``request_id``'s held blocks may be freed (reported by the next ``get_finished``)."""
        with self._lock:
            self._sending_done.add(request_id)

    # ---- worker side ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        assert tuple(kv_cache.shape[1:]) == self.block_shape and kv_cache.dtype == self.dtype, \
            f"cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match the spec {self.block_shape} {self.dtype}"
        self.kv_cache = kv_cache

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for rid in meta.loads:
            job = self._scheduled.pop(rid, None)
            if job is None:
                continue
            job.started = time.time()
            job.in_place = self._loads_in_place()
            if job.is_async:
                job.deadline = time.monotonic() + self._watchdog_s()
                with self._lock:
                    self._running[rid] = job
                self._pool.submit(self._run, job)
            else:
                self._run(job)

    def _run(self, job: LoadJob) -> None:
        try:
            errors = self._load(job)
        except KVLoadError as e:
            errors = {b: e for _, b, _ in job.blocks}
        except Exception as e:  # a bug or an unexpected library error must still end the load
            logger.exception("%s: load of request %s crashed", self.name, job.request_id)
            errors = {b: KVLoadError(repr(e)) for _, b, _ in job.blocks}
        with self._lock:
            if job.finished:   # the watchdog reported it (not in place: its late writes were dropped)
                return
            self._finish_job(job, errors)

    def _finish_job(self, job: LoadJob, errors: dict[int, KVLoadError]) -> None:
        # caller holds self._lock
        job.finished = True
        self._running.pop(job.request_id, None)
        self._bad_blocks |= set(errors)
        if job.is_async:
            self._recving_done.add(job.request_id)
        if job.request_id in self._free_after_load:
            self._free_after_load.discard(job.request_id)
            self._sending_done.add(job.request_id)
        by_kind: dict[str, list[KVLoadError]] = {}
        for e in errors.values():
            by_kind.setdefault(e.kind, []).append(e)
        for errs in by_kind.values():
            self.stats.failure(errs[0], job.request_id, len(errs))
        ok = len(job.blocks) - len(errors)
        self.stats.add("kv_blocks_loaded", ok)
        self.stats.add("kv_bytes_loaded", ok * self.spec.block_bytes)
        end = time.time()
        self.stats.add("kv_loads")
        self.stats.add("kv_load_seconds", end - job.started)
        if job.record is not None:   # read by tracing when the request finishes (pdserve.tracing)
            job.record.update(connector=self.name, start=job.started, end=end, blocks=len(job.blocks),
                              bytes=ok * self.spec.block_bytes, failed_blocks=len(errors),
                              errors=sorted(by_kind), verified=self.verify_checksums)

    def _write_block(self, job: LoadJob, block_id: int, payload: memoryview) -> None:
        """Copy a verified block's bytes into the cache unless the job was cancelled (its blocks may belong to others
        now). On CPU a plain memcpy (torch's copy_ fans out to OpenMP threads, which stall on a busy host)."""
        with self._lock:
            if job.cancelled:
                raise LoadTimeout("load cancelled after its deadline")
            dest = self.kv_cache[block_id]
            if dest.device.type == "cpu":
                tensor_bytes(dest)[:] = payload
            else:
                src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).view(self.block_shape)
                dest.copy_(src, non_blocking=False)

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """Saves happen when the engine reports computed tokens (request_scheduled_for_save / request_finished)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        now = time.monotonic()
        with self._lock:
            for job in [j for j in self._running.values() if now > j.deadline]:
                if job.in_place and job.reads_in_flight:   # a read still writes its blocks: reported once none does
                    if not job.cancelled:
                        self.stats.add("kv_loads_overdue")
                        logger.warning("%s: load of request %s overran its deadline; its blocks stay held until its "
                                       "reads return", self.name, job.request_id)
                    job.cancelled = True
                    continue
                job.cancelled = True   # no new block is read; writes through _write_block are dropped
                self._finish_job(job, {b: LoadTimeout(f"no answer within {self.load_timeout_s}s") for _, b, _ in job.blocks})
            sending, recving = self._sending_done | self._finished_sending(), self._recving_done
            self._sending_done, self._recving_done = set(), set()
        return sending, recving

    def _finished_sending(self) -> set[str]:
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def metrics(self) -> dict[str, float]:
        return self.stats.snapshot()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.handoffs.shutdown()
