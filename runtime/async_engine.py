"""Runs one ``LLMEngine`` on a background thread so that requests from many HTTP clients share its batches.

Ownership: only the engine thread touches the engine (``add_request``, ``abort_request``, ``step``, ``get_stats``,
``take_kv_events``). The asyncio side talks to it through a command queue (adds carry a future that reports the
engine's ``ValueError`` back) and receives outputs through one ``RequestStream`` per request, fed with
``loop.call_soon_threadsafe`` once per step. Outputs are cumulative, so a stream keeps only the latest one: memory per
request is bounded however slowly its client reads.

The thread is an ``EngineThread`` (runtime/engine_thread.py): pass the one that built the engine, so that one thread
does all of the engine's torch work. It steps while the engine has unfinished requests and sleeps on an event
otherwise. After every step it publishes KV events (if a publisher is attached), stores a stats snapshot for
``/metrics`` and records whether the engine still has work (``engine_busy``: requests, or KV transfers still holding
blocks), which a drain waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from typing import Any, Callable

from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.engine_thread import EngineThread, run_into
from pdserve.runtime.kv_event_publisher import KVEventPublisher
from pdserve.runtime.metrics import ServerMetrics
from pdserve.runtime.outputs import RequestOutput
from pdserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; every in-flight request fails with this and the server reports unhealthy."""


class RequestStream:
    """Latest output of one request, handed from the engine thread to the request's coroutine."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.started = False           # an output arrived (the request left the waiting queue)
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._aborted = False
        self._event = asyncio.Event()

    def _put(self, output: RequestOutput) -> None:
        self.started = True
        self._latest = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def _abort(self) -> None:
        self._aborted = True
        self._event.set()

    async def next(self) -> RequestOutput | None:
        """The newest output since the last call. ``None`` means the request was aborted by the server (shutdown);
        raises ``EngineDeadError`` if the engine crashed."""
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            self.finished = True
            raise self._error
        if self._latest is not None and (self._latest.finished or not self._aborted):
            out, self._latest = self._latest, None
            self.finished = out.finished
            return out
        self.finished = True
        return None


class AsyncEngine:
    def __init__(self, engine: EngineClient, *, metrics: ServerMetrics | None = None,
                 kv_publisher: KVEventPublisher | None = None, idle_poll_s: float = 0.5,
                 thread: EngineThread | None = None):
        self.engine = engine
        self.metrics = metrics
        self.kv_publisher = kv_publisher
        self.idle_poll_s = idle_poll_s
        self.dead: BaseException | None = None
        self.engine_busy = False   # written by the engine thread only (a bool store is atomic)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}   # touched only on the event loop
        # (command, the future its caller awaits or None): failed, not dropped, if the engine thread dies
        self._commands: deque[tuple[Callable[[], None], concurrent.futures.Future | None]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread, self._own_thread = thread, thread is None
        self._running: concurrent.futures.Future | None = None

    # ---- lifecycle (event loop side) ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = self._thread or EngineThread()
        self._running = self._thread.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._running is not None:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                self._running.result(timeout)
        if self._own_thread and self._thread is not None:
            self._thread.close(timeout)

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    @property
    def num_unstarted(self) -> int:
        """Requests accepted but without a first output yet: the server's view of the waiting queue."""
        return sum(1 for s in self._streams.values() if not s.started)

    def is_inflight(self, request_id: str) -> bool:
        return request_id in self._streams

    # ---- requests (event loop side) ----
    async def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, **kwargs: Any) -> RequestStream:
        """Queue a request; raises ``ValueError`` (bad input, from the engine) or ``EngineDeadError``."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            await self.call(self.engine.add_request, request_id, prompt, params, **kwargs)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Forget a stream; aborts the request in the engine (freeing its blocks) unless it already finished."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if not stream.finished:
            rid = stream.request_id
            self._submit(lambda: self.engine.abort_request([rid]))

    def abort_all(self) -> int:
        """Abort every in-flight request (shutdown); their streams end with ``None``. Returns how many."""
        streams = list(self._streams.values())
        ids = [s.request_id for s in streams]
        if ids:
            self._submit(lambda: self.engine.abort_request(ids))
        for s in streams:
            s._abort()
        return len(ids)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the engine thread between two steps: the engine's methods, and work that uses
        torch (loading an adapter); raises what it raises, or ``EngineDeadError``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: run_into(lambda: fn(*args, **kwargs), fut), fut)
        return await asyncio.wrap_future(fut)

    def _submit(self, command: Callable[[], None], fut: concurrent.futures.Future | None = None) -> None:
        self._commands.append((command, fut))
        self._wake.set()
        if self.dead is not None:   # the engine thread died (maybe just now): nobody else will run it
            self._fail_pending()

    def _fail_pending(self) -> None:
        """Fail the futures of commands the engine thread will never run (each command is popped exactly once)."""
        while True:
            try:
                _, fut = self._commands.popleft()
            except IndexError:
                return
            if fut is not None:
                with contextlib.suppress(concurrent.futures.InvalidStateError):   # cancelled by its caller
                    fut.set_exception(EngineDeadError(f"engine loop died: {self.dead}"))

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                while self._commands:
                    command, _ = self._commands.popleft()
                    try:
                        command()
                    except Exception:  # noqa: BLE001 - an abort of an unknown id must not stop the loop
                        logger.exception("engine command failed")
                self.engine_busy = self.engine.has_unfinished_requests()
                if not self.engine_busy:
                    self._after_step(0)
                    self._wake.wait(self.idle_poll_s)
                    continue
                outputs = self.engine.step()
                # before the outputs are dispatched: a request that finished holding KV for a reader still counts
                self.engine_busy = self.engine.has_unfinished_requests()
                self._after_step(len(outputs))
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:  # noqa: BLE001 - fail everything loudly instead of hanging clients
            logger.exception("engine loop crashed")
            self.dead = e
            self._fail_pending()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine loop died: {e}"))

    def _after_step(self, batch_size: int) -> None:
        events = self.engine.take_kv_events()
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(events)
            if self.metrics is not None:
                self.metrics.kv_event_batches.inc()
        if self.metrics is not None:
            self.metrics.set_engine_stats(self.engine.get_stats())
            connector = self.engine.connector
            if connector is not None:
                self.metrics.set_connector_metrics(connector.metrics(), self.engine.config.kv_transfer.connector)
            if batch_size:
                self.metrics.observe_step(batch_size)

    # ---- event loop, called from the engine thread ----
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)

    def _fail_all(self, error: BaseException) -> None:
        for s in self._streams.values():
            s._fail(error)
