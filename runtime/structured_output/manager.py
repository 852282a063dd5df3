"""StructuredOutputManager: the engine's one owner of grammars (compile cache, per-request matchers, bitmasks).

Threads: ``compile`` / ``validate`` may be called from any thread (the server validates a request's grammar before
queueing it, so a bad schema is a 400, and the compiled grammar lands in the shared cache). Everything per request
(``add_request``, ``ready``, ``grammar_bitmask``, ``accept``, ``remove``) runs on the engine thread only.

Compiles run on a small thread pool, never on the engine thread: a request whose grammar is not compiled yet waits
(``ready`` is False) while others are scheduled. The cache is an LRU of futures keyed by (backend asked, kind, spec),
bounded to ``cache_size`` entries; a failed compile is cached too, so the same bad schema fails fast.

The matcher follows ``Request.output_token_ids`` by count (``accept`` feeds it the tokens it has not seen and rolls it back
when the list got shorter), so a recompute after preemption, which re-runs the prompt but keeps the output tokens, can
never advance it twice, and rejected speculative tokens are undone with ``rollback``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.runtime.structured_output.backends import XGRAMMAR_UNENFORCED, Backend, BACKENDS, Matcher, uses_keywords
from pdserve.runtime.structured_output.params import BACKEND_CHOICES, StructuredOutputsParams

log = logging.getLogger(__name__)


@dataclass
class _RequestGrammar:
    params: StructuredOutputsParams
    future: concurrent.futures.Future
    added: float
    backend: Backend | None = None
    matcher: Matcher | None = None
    num_accepted: int = 0


NO_TOKEN_CAN_START = "no token of this model's vocabulary can start the constraint"
# A request that reached a state no token can continue ends with this error: the constraint's fault, a 400.
DEAD_END = "structured output: no token of this model's vocabulary can continue the constraint"
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class StructuredOutputStats:
    """Cumulative counters (read by runtime/structured_output/metrics.py from any thread)."""

    compile_buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))  # last: +Inf
    compile_seconds_sum: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    requests_by_kind: Counter = field(default_factory=Counter)

    def observe_compile(self, seconds: float) -> None:
        self.compile_buckets[next((i for i, b in enumerate(COMPILE_BUCKETS) if seconds <= b),
                                  len(COMPILE_BUCKETS))] += 1
        self.compile_seconds_sum += seconds


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *, backend: str = "auto",
                 cache_size: int = 256, compile_threads: int = 2, compile_timeout_s: float = 30.0) -> None:
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"unknown structured outputs backend {backend!r}; choose from {BACKEND_CHOICES}")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.default_backend = backend
        self.cache_size, self.compile_timeout_s = cache_size, compile_timeout_s
        self.stats = StructuredOutputStats()
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self._requests: dict[str, _RequestGrammar] = {}
        self._words = (vocab_size + 31) // 32

    # ---- compiling (any thread) ----
    def backend(self, name: str) -> Backend:
        with self._backend_lock:   # not the cache lock: building one takes a while, compile() must not wait on it
            if name not in self._backends:   # built on first use: each reads the whole vocabulary once
                self._backends[name] = BACKENDS[name](self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backends[name]

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of ``(backend, compiled grammar)``; its exception is a ``ValueError`` naming what is wrong."""
        asked = params.backend or self.default_backend
        kind, spec = params.key()     # ValueError (bad JSON text) right here, in the caller's thread
        key = (asked, kind, spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return fut
            self.stats.cache_misses += 1
            fut = self._pool.submit(self._compile, asked, kind, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, asked: str, kind: str, spec: str) -> tuple[Backend, Any]:
        t0 = time.perf_counter()
        try:
            backend, compiled = ((self.backend(asked), self.backend(asked).compile(kind, spec)) if asked != "auto"
                                 else self._compile_auto(kind, spec))
            self._check_can_start(backend, compiled)
            return backend, compiled
        finally:
            with self._lock:
                self.stats.observe_compile(time.perf_counter() - t0)

    def _check_can_start(self, backend: Backend, compiled: Any) -> None:
        """A constraint whose first token no token of this vocabulary can satisfy (e.g. a regex on a byte the
        tokenizer has no token for) is the client's error: refuse it with the compile, before anything is queued."""
        bitmask = torch.full((1, self._words), -1, dtype=torch.int32)
        backend.fill_bitmask([backend.matcher(compiled)], [0], bitmask)
        if not bool(bitmask.any()):
            raise ValueError(NO_TOKEN_CAN_START)

    def _compile_auto(self, kind: str, spec: str) -> tuple[Backend, Any]:
        """xgrammar, unless the schema uses keywords only llguidance enforces or xgrammar cannot read a grammar
        (Lark): then llguidance. The error reported is xgrammar's when neither can compile it."""
        import json

        if kind == "json" and uses_keywords(json.loads(spec.removeprefix("nows:")), XGRAMMAR_UNENFORCED):
            try:
                return self.backend("llguidance"), self.backend("llguidance").compile(kind, spec)
            except ValueError:
                pass   # llguidance refuses another keyword: xgrammar still enforces the rest
        xgr = self.backend("xgrammar")
        try:
            return xgr, xgr.compile(kind, spec)
        except ValueError as e:
            if kind != "grammar":
                raise
            try:
                return self.backend("llguidance"), self.backend("llguidance").compile(kind, spec)
            except ValueError:
                raise e from None

    def validate(self, params: StructuredOutputsParams, timeout: float | None = None) -> str:
        """Compile (or find in the cache) ``params``' grammar, waiting at most ``timeout`` (default: the compile
        timeout); returns the backend name. Raises ``ValueError`` with the reason, or on timeout."""
        fut = self.compile(params)
        try:
            backend, _ = fut.result(self.compile_timeout_s if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"grammar compilation took longer than {self.compile_timeout_s:g}s") from None
        return backend.name

    # ---- requests (engine thread) ----
    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        fut = self.compile(params)
        self._requests[request_id] = _RequestGrammar(params, fut, time.monotonic())
        self.stats.requests_by_kind[params.kind] += 1

    def has_requests(self) -> bool:
        return bool(self._requests)

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def ready(self, request_id: str) -> bool:
        """True once the request's matcher exists; raises ``ValueError`` if its grammar failed or timed out."""
        g = self._requests[request_id]
        if g.matcher is not None:
            return True
        if not g.future.done():
            if time.monotonic() - g.added > self.compile_timeout_s:
                raise ValueError(f"grammar compilation took longer than {self.compile_timeout_s:g}s")
            return False
        try:
            g.backend, compiled = g.future.result()   # re-raises the compile's ValueError
        except concurrent.futures.CancelledError:
            raise ValueError("grammar compilation was cancelled") from None
        g.matcher = g.backend.matcher(compiled)
        return True

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def is_terminated(self, request_id: str) -> bool:
        g = self._requests.get(request_id)
        return g is not None and g.matcher is not None and g.matcher.is_terminated()

    def is_ready(self, request_id: str) -> bool:
        """The request has a matcher (its rows must be masked)."""
        g = self._requests.get(request_id)
        return g is not None and g.matcher is not None

    def grammar_bitmask(self, request_ids: list[str]) -> torch.Tensor:
        """int32 ``(len(request_ids), ceil(vocab / 32))`` on the CPU: row i allows the tokens the grammar of
        ``request_ids[i]`` (each ``is_ready``) allows next. One native fill call per backend present in the batch."""
        groups: dict[str, tuple[Backend, list[Matcher], list[int]]] = {}
        for i, rid in enumerate(request_ids):
            g = self._requests[rid]
            groups.setdefault(g.backend.name, (g.backend, [], []))
            groups[g.backend.name][1].append(g.matcher)
            groups[g.backend.name][2].append(i)
        bitmask = torch.full((len(request_ids), self._words), -1, dtype=torch.int32)
        for backend, matchers, rows in groups.values():
            backend.fill_bitmask(matchers, rows, bitmask)
        return bitmask

    def accept(self, request_id: str, output_token_ids: list[int]) -> bool:
        """Bring the matcher to ``output_token_ids`` (advance over new tokens, roll back dropped ones). False when the
        grammar refuses a token (the request must fail: it can only happen if the mask was not applied)."""
        g = self._requests.get(request_id)
        if g is None or g.matcher is None:
            return True
        n = len(output_token_ids)
        if n < g.num_accepted:
            g.matcher.rollback(g.num_accepted - n)
            g.num_accepted = n
        new = output_token_ids[g.num_accepted:]
        if not new:
            return True
        ok = g.matcher.accept(new)
        g.num_accepted = n
        return ok

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

