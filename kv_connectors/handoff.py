"""Prefill handoffs off the engine thread: the blocking part of a handoff (a store write, block checksums) runs on the
connector's handoff thread under a deadline, and its ``kv_transfer_params`` are collected later.

A connector that uses this answers ``start_request_finished`` with ``pending=True`` and the blocks held (delay_free);
the engine then holds the request's response until ``get_finished_handoffs`` returns its params. Each job ends in
exactly one of:

- ``publish(result)``: the work returned before the deadline; its params are the handoff's;
- ``fallback()``: the work raised, or the deadline passed first (the work goes on in the background, its result unused):
  the params the connector gives a failed handoff (the decode side then finds fewer blocks and recomputes them).

Either way ``release(published)`` runs on the handoff thread when the work has really ended, and only then may the
connector let the blocks go: a write that outlives its deadline still reads them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.kv_connectors.load_errors import logger

Params = dict[str, Any]


@dataclass
class _Job:
    deadline: float
    fallback: Callable[[], Params]
    params: Params | None = None       # set once, under the lock: by publish, or by fallback


class HandoffJobs:
    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"pdserve-{name}-handoff")

    def start(self, request_id: str, timeout_s: float, work: Callable[[], Any], publish: Callable[[Any], Params],
              fallback: Callable[[], Params], release: Callable[[bool], None]) -> None:
        """Run ``work`` on the handoff thread; the params are ``publish(its result)`` if it returns within
        ``timeout_s``, else ``fallback()``. ``publish`` and ``fallback`` run under this object's lock: keep them
        cheap."""
        job = _Job(time.monotonic() + timeout_s, fallback)
        with self._cond:
            self._jobs[request_id] = job
        self._pool.submit(self._run, request_id, job, work, publish, release)

    def _run(self, request_id: str, job: _Job, work: Callable[[], Any], publish: Callable[[Any], Params],
             release: Callable[[bool], None]) -> None:
        published = False
        try:
            result = work()
            with self._cond:
                if job.params is None and time.monotonic() <= job.deadline:
                    job.params, published = publish(result), True
        except Exception:  # noqa: BLE001 - a failed handoff falls back, it never takes the engine down
            logger.exception("%s: handoff of request %s failed", self.name, request_id)
        finally:
            with self._cond:
                if job.params is None:
                    job.params = job.fallback()
                self._cond.notify_all()
            release(published)

    def _settle(self, now: float) -> None:
        # caller holds the lock
        for job in self._jobs.values():
            if job.params is None and now > job.deadline:
                job.params = job.fallback()

    def take_finished(self) -> dict[str, Params]:
        """Params of the handoffs settled (published, failed or overdue) since the last call, each reported once."""
        with self._cond:
            self._settle(time.monotonic())
            done = {rid: job.params for rid, job in self._jobs.items() if job.params is not None}
            for rid in done:
                del self._jobs[rid]
        return done

    def wait(self, request_id: str) -> Params:
        """Block until ``request_id``'s handoff settles (at most its deadline) and take its params: the synchronous
        ``request_finished``."""
        with self._cond:
            job = self._jobs[request_id]
            while job.params is None and (left := job.deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            self._settle(time.monotonic())
            del self._jobs[request_id]
            return job.params

    def flush(self, timeout: float) -> None:
        """Wait until every job submitted so far has ended (its work done, blocks released)."""
        self._pool.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
