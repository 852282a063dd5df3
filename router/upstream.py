"""Pooled HTTP to the pods, and the retry loop that runs before the first byte reaches the client.

``Upstream.request`` sends one request to one pod. ``Upstream.dispatch`` picks a pod (via the caller's ``pick``,
which must skip the urls it is given), sends, and tries another pod after a short backoff, at most ``max_retries``
extra times, only when the first pod provably did not run the request: it could not be connected to, it dropped the
connection before answering (pods abort a request whose connection closes), or it answered 408/429/5xx. A timeout of
a request that was sent is never retried: the pod may still be working on it, and a retry would run it twice (the
caller answers 504). It returns an ``Attempt`` holding the response whose headers arrived; the caller relays the body
and must call ``finish()``. Every attempt updates the pod's in-flight count, circuit breaker and the metrics.

Breaker failures are what says the pod is broken: connect errors, dropped connections, timeouts, 5xx answers, but not
a 503 with ``Retry-After`` (the pod is healthy and shedding load: its queue is full) nor any 4xx.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Callable

from pdserve import tracing
from pdserve.router.config import RouterConfig
from pdserve.router.drain_signal import note_response
from pdserve.router.endpoints import Endpoint
from pdserve.router.http_client import Pool, Response
from pdserve.router.metrics import RouterMetrics

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class Attempt:
    """A response whose headers arrived from ``endpoint``; ``finish()`` releases the pod's in-flight slot."""

    __slots__ = ("endpoint", "resp", "role", "started", "_metrics", "_done")

    def __init__(self, endpoint: Endpoint, resp: Response, role: str, started: float,
                 metrics: RouterMetrics):
        self.endpoint, self.resp, self.role, self.started, self._metrics = endpoint, resp, role, started, metrics
        self._done = False

    def finish(self, ok: bool = True) -> None:
        if self._done:
            return
        self._done = True
        self.endpoint.in_flight -= 1
        self.resp.release()  # not fully read (client gone, cancelled): closes, so the pod sees it and aborts
        if not ok:  # the body broke off mid-stream: the pod failed us after all
            self.endpoint.breaker.record_failure()
        self._metrics.child(self._metrics.upstream_latency, self.role).observe(time.perf_counter() - self.started)


class UpstreamFailure(Exception):
    """No pod produced a response (none left to try, or all attempts errored before the headers)."""

    def __init__(self, message: str, tried: set[str], timed_out: bool = False):
        super().__init__(message)
        self.tried = tried  # urls of the pods that were tried
        self.timed_out = timed_out  # the last attempt was sent and timed out (not retried: answer 504)


def is_overload(resp: Response) -> bool:
    """A pod shedding load (queue full) says 503 + Retry-After: not a failure of the pod."""
    return resp.status == 503 and "retry-after" in resp.headers


class Upstream:
    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics):
        self.cfg = cfg
        self.metrics = metrics
        self.pool: Pool | None = None
        # pods started with --api-key accept the router with this key (proxy, handoff and GET passthrough alike)
        self.auth = {"authorization": f"Bearer {cfg.upstream_api_key}"} if cfg.upstream_api_key else {}

    async def start(self) -> None:
        self.pool = Pool(connect_timeout=self.cfg.connect_timeout, timeout=self.cfg.request_timeout)

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    async def dispatch(self, role: str, pick: Callable[[set[str]], Endpoint | None], method: str, path: str,
                       body: bytes | None, headers: dict[str, str], retries: int | None = None) -> Attempt:
        retries = self.cfg.max_retries if retries is None else retries
        if self.auth:
            headers = {**headers, **self.auth}
        tried: set[str] = set()
        last: str = "no healthy endpoint"
        held: Attempt | None = None  # a retryable answer, returned as is if no other pod is left to try
        for attempt in range(retries + 1):
            ep = pick(tried)
            if ep is None:
                break
            if held is not None:
                held.finish()
                held = None
            if attempt:
                self.metrics.child(self.metrics.retries, role).inc()
                tracing.event("retry", role=role, attempt=attempt, previous_error=last)
                await asyncio.sleep(self.cfg.retry_backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            tried.add(ep.url)
            ep.in_flight += 1
            ep.breaker.on_dispatch()
            started = time.perf_counter()
            try:
                resp = await self.pool.request(method, ep.url + path, body, headers)
            except asyncio.CancelledError:
                ep.in_flight -= 1
                ep.breaker.probing = False
                raise
            except (asyncio.TimeoutError, OSError) as e:  # http_client's ConnectError/ProtocolError are OSErrors
                ep.in_flight -= 1
                ep.breaker.record_failure()
                kind = "timeout" if isinstance(e, asyncio.TimeoutError) else "connect"
                self.metrics.child(self.metrics.upstream_errors, role, kind).inc()
                last = f"{ep.url}: {kind} error: {e or type(e).__name__}"
                if kind == "timeout" and method != "GET":  # sent, maybe still running: a retry would run it twice
                    if held is not None:  # an earlier pod's answer is still the best we have
                        return held
                    raise UpstreamFailure(f"{ep.url}: no answer within {self.cfg.request_timeout} s", tried,
                                          timed_out=True) from None
                continue
            self.metrics.child(self.metrics.ttfb, role).observe(time.perf_counter() - started)
            note_response(ep, resp.status, resp.headers)  # a draining pod leaves the next pick at once
            if resp.status >= 500 and not is_overload(resp):
                ep.breaker.record_failure()
            else:
                ep.breaker.record_success()
            result = Attempt(ep, resp, role, started, self.metrics)
            if resp.status in RETRYABLE_STATUS and attempt < retries:
                self.metrics.child(self.metrics.upstream_errors, role, str(resp.status)).inc()
                held = result
                continue
            return result
        if held is not None:
            return held
        raise UpstreamFailure(last, tried)
