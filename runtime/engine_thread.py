"""The one thread that does a server's torch work: it builds the engine, then runs its loop (``AsyncEngine``).

Why one thread: torch's CPU ops run on OpenMP (libgomp), which keeps a team of worker threads for every thread that
has started parallel work. Once it manages more threads than the process has CPUs, a worker spins only ~100 times
before it sleeps, so each of a step's ~1,000 parallel regions wakes it through the kernel. On 2 cores, an engine
built on the main thread (whose team stays alive) and stepped on another ran the issue-10 workload 1.06-1.30x
slower in process (two sessions), its OpenMP worker busy ~50% of the time instead of ~100% (benchmarks/RESULTS.md,
"One thread for the engine's torch work").
vLLM's engine core likewise builds and steps its model on one thread. Other torch work of a server (loading a LoRA
adapter at run time) goes through ``AsyncEngine.call`` onto this thread too.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread that runs the callables given to it, one at a time, in order."""

    def __init__(self, name: str = "engine-loop") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``fn``; its future has its result or exception."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the thread and wait for it (e.g. building the engine)."""
        return self.submit(lambda: fn(*args, **kwargs)).result()

    def close(self, timeout: float) -> None:
        """Let the thread end after what is queued; wait up to ``timeout`` seconds for it."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            run_into(*job)


def run_into(fn: Callable[[], Any], fut: concurrent.futures.Future) -> None:
    """Run ``fn`` into ``fut`` (its result or exception), unless ``fut`` was cancelled first."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)
