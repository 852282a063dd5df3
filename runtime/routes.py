"""The OpenAI-compatible app over one engine: ``build_app(engine, options)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming shaped like OpenAI's),
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` (API key protected when one is set), and the open
``GET /health``, ``GET /metrics``, ``GET /version``. Every error is OpenAI-shaped JSON (``protocol.ApiError``).

Request life: read the body (json_body) -> parse (protocol) -> map to prompt ids and sampling params, checked as the
engine will check them (request_mapping) -> queue bound and KV handoff checks -> ``AsyncEngine.add`` -> read the
request's stream until finished (streaming), emitting deltas of the engine's cumulative outputs (responses). A
client that goes away aborts its request (the engine frees its blocks). ``drain`` (SIGTERM, runtime/drain.py)
answers 503 to new requests and lets in-flight ones finish within the grace period.

New endpoints are added in ``build_app`` (or in a module of their own that ``build_app`` calls with the app) with
``dependencies=[Depends(guard)]`` unless they must stay open (probes); each finds the shared ``ServerState`` as
``request.app.state.pdserve``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import __version__, tracing
from pdserve.runtime import drain as drain_mod
from pdserve.runtime import lora_routes
from pdserve.runtime import metrics as metrics_mod
from pdserve.runtime import request_mapping as mapping
from pdserve.runtime.structured_output.metrics import StructuredOutputCollector
from pdserve.runtime import streaming
from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.engine_thread import EngineThread
from pdserve.runtime.json_body import read_json
from pdserve.runtime.kv_event_publisher import KVEventPublisher
from pdserve.runtime.metrics import RequestTimer, ServerMetrics
from pdserve.runtime.protocol import (RETRY_AFTER_S, ApiError, ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, SamplingRequest, TokenizeRequest, error_body, parse)
from pdserve.runtime.responses import ResponseBuilder
from pdserve.runtime.server_state import ServerOptions, ServerState
from pdserve.runtime.validation import InvalidParam

logger = logging.getLogger(__name__)


def build_app(engine: EngineClient, options: ServerOptions = ServerOptions(), *,
              kv_publisher: KVEventPublisher | None = None, engine_thread: EngineThread | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine loop runs for the app's lifespan, on ``engine_thread`` (the
    thread that built the engine; a new one if None)."""
    metrics = ServerMetrics(engine.served_model_name, kv_connector=engine.config.kv_transfer.connector is not None)
    metrics.set_model_weight_bytes(engine.weight_bytes)
    metrics.registry.register(StructuredOutputCollector(engine.structured.stats, engine.served_model_name))
    state = ServerState(engine, options, metrics, AsyncEngine(engine, metrics=metrics, kv_publisher=kv_publisher,
                                                                thread=engine_thread))
    builder = ResponseBuilder(engine, tool_parser=options.tool_call_parser)
    kv_fingerprint = drain_mod.fingerprint(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        try:
            yield
        finally:
            state.async_engine.abort_all()
            state.async_engine.stop()
            state.cpu_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pdserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.pdserve = state
    install_error_handlers(app)

    guarded = [Depends(guard)]   # every endpoint but the probes

    @app.get("/health")
    async def health() -> Response:
        if state.async_engine.dead is not None:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={drain_mod.DRAIN_HEADER: "1"})
        return JSONResponse({"status": "ok", "role": options.role, "kv_fingerprint": kv_fingerprint})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics_mod.CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards(state)}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = parse(TokenizeRequest, await read_json(request))
        mapping.check_model(state, req.model)
        if req.messages is not None:
            ids = await mapping.chat_ids(state, [{"role": m.role, "content": m.text()} for m in req.messages],
                                         req.add_generation_prompt, None)
        else:
            ids = await mapping.text_ids(state, req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = parse(DetokenizeRequest, await read_json(request))
        mapping.check_model(state, req.model)
        mapping.check_tokens(state, req.tokens, "tokens")
        return {"prompt": await state.off_loop(engine.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        return await _serve(request, state, builder, "completion", req, await mapping.completion_input(state, req))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request))
        return await _serve(request, state, builder, "chat", req, await mapping.chat_input(state, req))

    lora_routes.install_routes(app, state, guarded, read_json)
    return app


def guard(request: Request) -> None:
    """API key and drain checks for the inference endpoints (a FastAPI dependency)."""
    state: ServerState = request.app.state.pdserve
    key = state.options.api_key
    if key:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
    if state.draining:
        state.metrics.rejected("draining")
        raise ApiError(503, "server is shutting down", headers={"Retry-After": RETRY_AFTER_S,
                                                                drain_mod.DRAIN_HEADER: "1"})
    if state.async_engine.dead is not None:
        raise ApiError(503, "engine is not running", headers={"Retry-After": RETRY_AFTER_S})


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """The ``/v1/models`` entries: the served model, then the models served beside it (LoRA adapters)."""
    engine = state.engine
    return [{"id": engine.served_model_name, "object": "model", "created": state.created, "owned_by": "pdserve",
             "root": engine.config.model.model or engine.served_model_name, "parent": None,
             "max_model_len": engine.max_model_len}, *lora_routes.model_cards(engine, state.created)]


async def _serve(request: Request, state: ServerState, builder: ResponseBuilder, kind: str, req: SamplingRequest,
                 inp: mapping.EngineInput) -> Response:
    ae, metrics = state.async_engine, state.metrics
    max_waiting = state.options.max_waiting
    if max_waiting is not None and ae.num_unstarted >= max_waiting:
        metrics.rejected("queue_full")
        raise ApiError(503, f"server overloaded: {ae.num_unstarted} requests waiting (limit {max_waiting})",
                       headers={"Retry-After": RETRY_AFTER_S})
    mapping.check_kv_handoff(request, state, req.kv_transfer_params)
    base_id, rid = mapping.request_ids(request, state, req.request_id)
    arrival = time.monotonic()
    try:
        stream = await ae.add(rid, inp.prompt_ids, inp.params, priority=req.priority, cache_salt=req.cache_salt,
                              kv_transfer_params=req.kv_transfer_params, arrival_time=time.time(),
                              **({"lora_name": inp.lora_name} if inp.lora_name is not None else {}))
    except KeyError as e:   # LoRANotFound: the adapter was unloaded since the request was checked
        raise ApiError(404, str(e), param="model", code="model_not_found") from None
    except InvalidParam as e:
        raise req.api_error(e) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    resp_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"
    traced = replace(inp.params, max_tokens=inp.max_tokens) if inp.params.max_tokens is None else inp.params
    trace = tracing.request_trace(request.headers, state.options.role, state.engine, base_id, traced,
                                  req.kv_transfer_params)   # None while tracing is off
    timer = RequestTimer(metrics, arrival, trace)
    headers = {"X-Request-Id": base_id}
    if req.stream:
        events = streaming.sse_events(builder, kind, req, resp_id, inp.prompt_ids, stream, timer)
        return streaming.EngineStreamResponse(events, state, stream, headers=headers)
    try:
        final = await streaming.await_final(request, state, stream, timer)
    finally:
        ae.release(stream)
    if final is not None and streaming.engine_failed(final):
        if streaming.constraint_dead_end(final):
            raise ApiError(400, final.error, code="structured_output_dead_end")
        raise ApiError(503, f"request failed in the engine: {final.error or 'unknown error'}",
                       code="engine_error", headers={"Retry-After": RETRY_AFTER_S})
    return JSONResponse(builder.full(kind, req, resp_id, inp.prompt_ids, final), headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-shaped JSON: ours (``ApiError``), Starlette's (404/405), FastAPI's, and a 500 for bugs."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = {404: "unknown route", 405: "method not allowed"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(msg, type_), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"invalid request: {e.errors()[:1]}", "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)
