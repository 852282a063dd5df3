"""The router's ASGI application (raw ASGI: the hot path is a few dict lookups, no framework on top).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (routed, P/D-orchestrated, SSE passed through),
``GET /v1/models`` (forwarded), ``GET /health`` and ``GET /metrics`` (the router's own). Admission, in order:
API key (401), concurrency limit (429 + Retry-After), body size (413), JSON object body (400; nesting too deep for
the parser included), request id (400, ``request_id.py``), tenant cache salt (``tenancy.py``). A large body is parsed
and tokenized on a bounded thread pool, never on the event loop. A client that disconnects cancels its request, which
closes the upstream connection so the pod aborts the work.

``RouterApp.lifespan`` starts the upstream connection pool, endpoint discovery, the health monitor and one KV event
subscriber per pod with an event source; all of it stops with the app.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from pdserve import tracing
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import KubePodSource, PodWatcher, static_specs
from pdserve.router.endpoints import Endpoint, EndpointPool
from pdserve.router.health import HealthMonitor
from pdserve.router.kv_event_subscriber import KVEventSubscriber
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import needs_tokens
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router import request_id as request_ids
from pdserve.router.prompt import PromptTokenizer, default_tokenizer_path
from pdserve.router.proxy import Router
from pdserve.router.responses import send_bytes, send_error, send_json
from pdserve.router.tenancy import CacheSalter, MissingTenant
from pdserve.router.upstream import Upstream
from pdserve.router.circuit_breaker import CircuitBreaker

log = logging.getLogger(__name__)

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RouterApp:
    def __init__(self, cfg: RouterConfig, tokenizer: PromptTokenizer | None = None, pod_source: Any = None):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.index = PrefixIndex(ttl=cfg.speculative_ttl)
        self.pool = EndpointPool(lambda: CircuitBreaker(cfg.cb_failure_threshold, cfg.cb_open_seconds))
        self.upstream = Upstream(cfg, self.metrics)
        self.tokenizer = tokenizer
        self.router = Router(cfg, self.pool, self.index, self.metrics, self.upstream, tokenizer)
        self.health = HealthMonitor(cfg, self.pool, self.metrics, self.index)
        self.pod_source = pod_source
        self.active = 0
        self._tasks: list[asyncio.Task] = []
        self._subscribers: dict[str, tuple[KVEventSubscriber, asyncio.Task]] = {}
        self._api_key = cfg.api_key.encode() if cfg.api_key else None
        self.salter = CacheSalter(cfg.cache_salt_from, cfg.tenant_header, cfg.cache_salt_secret)
        self.pool.add_listener(self._on_endpoint)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def _on_endpoint(self, event: str, ep: Endpoint) -> None:
        if event == "removed":
            sub = self._subscribers.pop(ep.url, None)
            if sub is not None:
                sub[1].cancel()
            self.index.forget_pod(ep.url)
            self.index.forget_history(ep.url)
            self.metrics.forget_endpoint(ep.url)
        elif ep.kv_events is not None and self.router.precise:
            s = KVEventSubscriber(ep.url, ep.kv_events, self.index, self.metrics)
            self._subscribers[ep.url] = (s, asyncio.get_running_loop().create_task(s.run()))

    async def startup(self) -> None:
        cfg = self.cfg
        if self.tokenizer is None and (needs_tokens(cfg.policy) or cfg.prefill or cfg.discover):
            path = cfg.tokenizer or await asyncio.to_thread(default_tokenizer_path)
            if path:
                try:
                    self.tokenizer = self.router.tokenizer = await asyncio.to_thread(
                        PromptTokenizer, path, cfg.token_cache_bytes)
                except Exception as e:  # noqa: BLE001
                    log.warning("cannot load tokenizer %s (%s); prefix scoring disabled, token counts estimated",
                                path, e)
            else:
                log.warning("no tokenizer; prefix scoring disabled, token counts estimated")
        await self.upstream.start()
        if cfg.discover:
            source = self.pod_source or KubePodSource(cfg.discover, cfg.namespace)
            watcher = PodWatcher(cfg, self.pool, source)
            self._tasks.append(asyncio.create_task(watcher.run()))
        else:
            self.pool.update(static_specs(cfg))
        self._tasks.append(asyncio.create_task(self.health.run()))

    async def shutdown(self) -> None:
        tasks = self._tasks + [t for _, t in self._subscribers.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.upstream.close()
        self.router.executor.shutdown(wait=False, cancel_futures=True)

    # -- ASGI -----------------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as e:  # noqa: BLE001
                        log.exception("router startup failed")
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def http(self, scope: dict, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            n_ok = sum(1 for e in self.pool if e.routable)
            await send_json(send, 200, {"status": "ok", "endpoints": len(self.pool), "routable": n_ok})
            return
        if path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if self._api_key is not None and not self._authorized(headers):
            self.metrics.child(self.metrics.requests, "unauthorized").inc()
            await send_error(send, 401, "invalid or missing API key", code="invalid_api_key")
            return
        if path in GENERATE_PATHS:
            if method != "POST":
                await send_error(send, 405, f"{method} not allowed on {path}")
                return
        elif path == "/v1/models" and method == "GET":
            try:
                request_id = request_ids.resolve(headers.get("x-request-id"), None)
            except request_ids.BadRequestId as e:
                await send_error(send, 400, str(e), param=e.param, code="invalid_request_id")
                return
            self.metrics.child(self.metrics.requests, await self.router.forward_get(path, request_id, send)).inc()
            return
        else:
            await send_error(send, 404, f"no route {method} {path}")
            return
        if self.active >= self.cfg.max_concurrency:
            self.metrics.child(self.metrics.requests, "rejected").inc()
            await send_error(send, 429, "too many requests in flight; retry later", code="overloaded",
                             retry_after=1)
            return
        self.active += 1
        self.metrics.in_flight.inc()
        try:
            await self.generate(path, headers, receive, send)
        finally:
            self.active -= 1
            self.metrics.in_flight.dec()

    def _authorized(self, headers: dict[str, str]) -> bool:
        auth = headers.get("authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode(), self._api_key)

    async def generate(self, path: str, headers: dict[str, str], receive, send) -> None:
        limit = self.cfg.max_body_bytes
        if int(headers.get("content-length") or 0) > limit:
            self.metrics.child(self.metrics.requests, "too_large").inc()
            await send_error(send, 413, f"request body exceeds {limit} bytes", code="body_too_large")
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.metrics.child(self.metrics.requests, "cancelled").inc()
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                self.metrics.child(self.metrics.requests, "too_large").inc()
                await send_error(send, 413, f"request body exceeds {limit} bytes", code="body_too_large")
                return
            chunks.append(body)
            if not msg.get("more_body"):
                break
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if len(raw) >= self.cfg.offload_bytes:
            body, why = await asyncio.get_running_loop().run_in_executor(self.router.executor, _parse_json, raw)
        else:
            body, why = _parse_json(raw)
        if not isinstance(body, dict):
            self.metrics.child(self.metrics.requests, "bad_request").inc()
            await send_error(send, 400, f"request body must be a JSON object{why}", code="invalid_json")
            return
        try:
            request_id = request_ids.resolve(headers.get("x-request-id"), body)
        except request_ids.BadRequestId as e:
            self.metrics.child(self.metrics.requests, "bad_request").inc()
            await send_error(send, 400, str(e), param=e.param, code="invalid_request_id")
            return
        if self.salter.active:
            try:
                self.salter.apply(headers, body)
            except MissingTenant as e:
                self.metrics.child(self.metrics.requests, "unauthorized").inc()
                await send_error(send, 401, str(e), code="missing_tenant", request_id=request_id)
                return
            raw = json.dumps(body).encode()

        # A client disconnect cancels the request's task (and so the upstream request); see module docstring. The
        # request runs as a child task so that cancelling it leaves this one uncancelled: no Task.uncancel (3.11+).
        loop = asyncio.get_running_loop()

        async def traced() -> str:
            with tracing.router_span(headers, path, request_id):
                outcome = await self.router.generate(path, raw, body, headers, request_id, send)
                tracing.annotate(pdserve__router__outcome=outcome)
            return outcome

        work = loop.create_task(traced())
        state = {"disconnected": False}

        async def watch_disconnect() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not work.done():
                state["disconnected"] = True
                work.cancel()

        watcher = loop.create_task(watch_disconnect())
        try:
            outcome = await work  # (if this task is cancelled, e.g. at shutdown, the await cancels ``work`` too)
            self.metrics.child(self.metrics.requests, outcome).inc()
        except asyncio.CancelledError:
            if not state["disconnected"] or not work.cancelled():
                raise
            self.metrics.child(self.metrics.requests, "cancelled").inc()
            log.info("request %s: client disconnected; upstream cancelled", request_id)
        finally:
            watcher.cancel()


def _parse_json(raw: bytes) -> tuple[Any, str]:
    """(the parsed body, "") or (None, why it is not JSON)."""
    try:
        return json.loads(raw), ""
    except RecursionError:
        return None, " (nested too deeply)"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f" (invalid JSON: {str(e)[:200]})"


def create_app(cfg: RouterConfig, **kwargs: Any) -> RouterApp:
    return RouterApp(cfg, **kwargs)
