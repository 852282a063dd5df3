"""Request orchestration: route one OpenAI request, run the P/D handoff when it pays, relay the answer.

Life of a generation request (``Router.generate``):
1. Context: prompt tokens and block hashes (only when the policy or P/D needs them).
2. Pick the decode pod first (decode|both pods, the policy's profile).
3. P/D: if prefill pods exist and the decode pod lacks more than ``pd_threshold`` prompt tokens, and a prefill pod
   is routable and not overloaded, run the prefill step (``pd.run_prefill``: up to ``prefill_attempts`` pods); on
   failure fall back to decode-only, or fail (``prefill_failure``).
4. Send to decode, retrying on other decode pods before the first byte (``Upstream.dispatch``), record speculative
   index entries, relay the body chunk by chunk (SSE) or whole (Content-Length).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pdserve import tracing
from pdserve.router.config import RouterConfig
from pdserve.router.drain_signal import compatible
from pdserve.router.endpoints import Endpoint, EndpointPool
from pdserve.router.framework import Profile, RequestContext
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd import client_body, decode_body, kv_secret, run_prefill
from pdserve.router.policies import build_profile, needs_tokens
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.plugins.lora_affinity import adapter_of
from pdserve.router.prompt import PromptTokenizer, block_hashes, estimate_tokens
from pdserve.router.responses import Send, send_bytes, send_error, send_json
from pdserve.router.upstream import Attempt, Upstream, UpstreamFailure

log = logging.getLogger(__name__)


class Router:
    def __init__(self, cfg: RouterConfig, pool: EndpointPool, index: PrefixIndex, metrics: RouterMetrics,
                 upstream: Upstream, tokenizer: PromptTokenizer | None = None):
        self.cfg, self.pool, self.index, self.metrics, self.upstream = cfg, pool, index, metrics, upstream
        self.tokenizer = tokenizer
        self.precise = needs_tokens(cfg.policy)
        self.decode_profile = build_profile(cfg, index)
        self.prefill_profile = build_profile(cfg, index)
        self.executor = ThreadPoolExecutor(max(1, cfg.tokenize_threads), thread_name_prefix="router-tokenize")

    def context(self, path: str, body: dict[str, Any], headers: dict[str, str], request_id: str) -> RequestContext:
        """Prompt tokens and block hashes (only what the policy or P/D needs). CPU-bound for a long prompt: callers on
        the event loop use ``context_async``."""
        ctx = RequestContext(path, body, headers, request_id)
        if self.precise or self.pool.prefillers:
            ids = None
            if self.tokenizer is not None:
                try:
                    ids = self.tokenizer.token_ids(path, body)
                except Exception as e:  # noqa: BLE001 (a template error must not fail routing; the pod will judge)
                    log.debug("tokenizing for routing failed: %s", e)
            if ids is None:
                ctx.num_prompt_tokens = estimate_tokens(body)
            else:
                ctx.num_prompt_tokens = len(ids)
                if self.precise:
                    salt, size = body.get("cache_salt"), self.cfg.block_size
                    ctx.lora_name = adapter_of(body.get("model"), list(self.pool))
                    if ctx.lora_name is None:
                        ctx.block_hashes = block_hashes(ids, size, salt)
                    for digest in {p.lora_digests.get(ctx.lora_name) for p in self.pool} - {None}:
                        ctx.lora_block_hashes[digest] = block_hashes(ids, size, salt, digest)
        return ctx

    async def context_async(self, path: str, body: dict[str, Any], headers: dict[str, str], request_id: str,
                            offload: bool) -> RequestContext:
        """``context``; on the bounded tokenizer pool when ``offload`` (a large body), so that rendering and tokenizing
        a long prompt never stalls the event loop (health checks, other clients' streams)."""
        if not offload or not (self.precise or self.pool.prefillers):
            return self.context(path, body, headers, request_id)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.context, path, body, headers, request_id)

    def picker(self, profile: Profile, ctx: RequestContext, pods: Callable[[], list[Endpoint]], role: str,
               accept: Callable[[Endpoint], bool] | None = None,
               first: Endpoint | None = None) -> Callable[[set[str]], Endpoint | None]:
        """A ``pick(exclude)`` for ``Upstream.dispatch``: ``first`` (already chosen) on the first call, then the
        profile's choice among the pods not yet tried."""
        chosen = [first]

        def pick(exclude: set[str]) -> Endpoint | None:
            if chosen[0] is not None and chosen[0].url not in exclude:
                ep, chosen[0] = chosen[0], None
                return ep
            cands = [p for p in pods() if p.url not in exclude and (accept is None or accept(p))]
            d = profile.schedule(ctx, cands)
            if d is None:
                return None
            self.metrics.child(self.metrics.decisions, role, d.endpoint.url).inc()
            tracing.annotate(**tracing.decision_attributes(role, d))
            return d.endpoint

        return pick

    async def generate(self, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str], request_id: str,
                       send: Send) -> str:
        """Handle one completion/chat request; returns the outcome label for metrics."""
        cfg, m = self.cfg, self.metrics
        body, raw = client_body(body, raw, cfg.trust_client_kv_params)
        ctx = await self.context_async(path, body, headers, request_id, len(raw) >= cfg.offload_bytes)
        decision = self.decode_profile.schedule(ctx, self.pool.decoders)
        if decision is None:
            await send_error(send, 503, "no healthy decode endpoint", code="no_endpoint", retry_after=5,
                             request_id=request_id)
            return "no_endpoint"
        decode_ep = decision.endpoint
        m.child(m.decisions, "decode", decode_ep.url).inc()
        m.child(m.scores, "decode").observe(decision.score)
        tracing.annotate(pdserve__prompt_tokens=ctx.num_prompt_tokens,
                         **tracing.decision_attributes("decode", decision))
        fwd = {"content-type": "application/json", "x-request-id": request_id}
        tracing.inject(fwd)   # the pods' spans are children of the router's
        payload = raw

        if self.pool.prefillers:
            uncached = ctx.num_prompt_tokens - int(ctx.matched_blocks.get(decode_ep.url, 0)) * cfg.block_size
            can_prefill = (lambda p: p.waiting <= cfg.prefill_max_waiting and p.url != decode_ep.url
                           and compatible(p, decode_ep))  # same KV fingerprint, else decode-only
            tracing.annotate(pdserve__pd__uncached_tokens=uncached)
            if uncached <= cfg.pd_threshold:
                m.child(m.pd_decisions, "local_short").inc()
            elif not any(p.routable and can_prefill(p) for p in self.pool.prefillers):
                m.child(m.pd_decisions, "local_no_prefill").inc()
            else:
                m.child(m.pd_decisions, "disaggregated").inc()
                pick = self.picker(self.prefill_profile, ctx, lambda: self.pool.prefillers, "prefill", can_prefill)
                res = await run_prefill(self.upstream, m, pick, path, body, fwd, cfg.prefill_attempts, kv_secret(cfg))
                tracing.annotate(pdserve__prefill__served_by=res.endpoint and res.endpoint.url,
                                 pdserve__prefill__error=res.error or None)
                if res.client_error is not None:
                    status, data = res.client_error
                    await send_bytes(send, status, data, extra=[(b"x-request-id", request_id.encode())])
                    return "bad_request"
                if res.kv_transfer_params is not None:
                    payload = json.dumps(decode_body(body, res.kv_transfer_params)).encode()
                    self.index.add_speculative(res.endpoint.url, ctx.hashes_for(res.endpoint))
                elif cfg.prefill_failure == "fail":
                    m.child(m.pd_fallbacks, "fail").inc()
                    await send_error(send, 502, f"prefill failed: {res.error}", code="prefill_failed",
                                     request_id=request_id)
                    return "upstream_error"
                else:
                    m.child(m.pd_fallbacks, "decode_only").inc()
                    log.warning("request %s: prefill failed (%s); decoding locally", request_id, res.error)

        pick = self.picker(self.decode_profile, ctx, lambda: self.pool.decoders, "decode", first=decode_ep)
        try:
            att = await self.upstream.dispatch("decode", pick, "POST", path, payload, fwd)
        except UpstreamFailure as e:
            if e.timed_out:
                await send_error(send, 504, f"upstream timed out: {e}", code="upstream_timeout", request_id=request_id)
                return "timeout"
            status = 502 if e.tried else 503
            await send_error(send, status, f"no endpoint could serve the request: {e}", code="upstream_error",
                             retry_after=5 if status == 503 else None, request_id=request_id)
            return "upstream_error" if e.tried else "no_endpoint"
        tracing.annotate(pdserve__decode__served_by=att.endpoint.url)
        if hashes := ctx.hashes_for(att.endpoint):
            self.index.add_speculative(att.endpoint.url, hashes)
        m.prompt_tokens.inc(ctx.num_prompt_tokens)
        m.prefix_hit_tokens.inc(min(ctx.num_prompt_tokens,
                                    int(ctx.matched_blocks.get(att.endpoint.url, 0)) * cfg.block_size))
        return await relay(att, send, request_id)

    async def forward_get(self, path: str, request_id: str, send: Send) -> str:
        """GET passthrough (``/v1/models``) to any routable pod, with retries; for ``/v1/models`` with several pods,
        the union of their models (LoRA adapters differ per pod) by ``id``."""
        pods = lambda: [p for p in self.pool if p.routable]  # noqa: E731
        if path == "/v1/models" and len(pods()) > 1:
            merged = await self._models_union(pods(), request_id)
            if merged is not None:
                await send_json(send, 200, merged, [(b"x-request-id", request_id.encode())])
                return "ok"

        def pick(exclude: set[str]) -> Endpoint | None:
            cands = [p for p in pods() if p.url not in exclude]
            return min(cands, key=lambda p: p.in_flight) if cands else None

        try:
            att = await self.upstream.dispatch("any", pick, "GET", path, None, {"x-request-id": request_id})
        except UpstreamFailure as e:
            await send_error(send, 503, f"no endpoint available: {e}", code="no_endpoint", retry_after=5)
            return "no_endpoint"
        return await relay(att, send, request_id)


    async def _models_union(self, pods: list[Endpoint], request_id: str) -> dict[str, Any] | None:
        """Every pod's /v1/models, merged by model id (first answer wins); None when no pod answered with a list."""
        async def one(ep: Endpoint) -> list[dict[str, Any]]:
            try:
                att = await self.upstream.dispatch("any", lambda tried: None if tried else ep, "GET", "/v1/models",
                                                   None, {"x-request-id": request_id}, retries=0)
            except UpstreamFailure:
                return []
            try:
                data = json.loads(await att.resp.read()) if att.resp.status == 200 else {}
                return [m for m in data.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
            except (ValueError, AttributeError):
                return []
            finally:
                att.finish()

        answers = await asyncio.gather(*(one(ep) for ep in pods))
        if not any(answers):
            return None
        models: dict[str, dict[str, Any]] = {}
        for data in answers:
            for m in data:
                models.setdefault(m["id"], m)
        return {"object": "list", "data": list(models.values())}


async def relay(att: Attempt, send: Send, request_id: str) -> str:
    """Stream the upstream answer to the client: whole when it has a Content-Length, else chunk by chunk as the
    chunks arrive (SSE), never buffering a stream. A pod failing mid-stream ends the stream with an SSE error event."""
    resp = att.resp
    ok = False
    ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
    headers = [(b"content-type", ctype), (b"x-request-id", request_id.encode())]
    if "retry-after" in resp.headers:  # an overloaded pod says when to come back; the client should hear it
        headers.append((b"retry-after", resp.headers["retry-after"].encode("latin-1")))
    started = False
    try:
        if "content-length" in resp.headers:
            data = await resp.read()
            headers.append((b"content-length", str(len(data)).encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            started = True
            await send({"type": "http.response.body", "body": data, "more_body": False})
        else:
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            started = True
            async for chunk in resp.iter_chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        ok = True
        return "ok" if resp.status < 400 else f"upstream_{resp.status // 100}xx"
    except (asyncio.TimeoutError, OSError) as e:
        log.warning("request %s: upstream %s failed mid-response: %s", request_id, att.endpoint.url, e)
        if not started:
            await send_error(send, 502, f"upstream failed: {e}", code="upstream_error", request_id=request_id)
        else:
            err = json.dumps({"error": {"message": f"upstream failed mid-stream: {e}", "type": "upstream_error",
                                        "param": None, "code": "upstream_error"}})
            await send({"type": "http.response.body", "body": f"data: {err}\n\n".encode(), "more_body": False})
        return "upstream_error"
    finally:
        att.finish(ok)
