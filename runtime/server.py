"""OpenAI-compatible HTTP server over one engine: ``build_app(engine, options)`` and ``run_server(args)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming shaped like OpenAI's),
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` (API key protected when one is set), and the open
``GET /health``, ``GET /metrics``, ``GET /version``. Every error is OpenAI-shaped JSON (``protocol.ApiError``).

Request life: validate -> tokenize (chat template for chat) -> length/queue checks -> ``AsyncEngine.add`` -> read the
request's stream until finished, emitting deltas of the engine's cumulative outputs. A client that goes away aborts its
request (the engine frees its blocks). ``drain(grace)`` (SIGTERM) answers 503 to new requests, lets in-flight ones
finish within the grace period, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import __version__, tracing
from pdserve.kv_connectors import kv_auth
from pdserve.runtime import drain as drain_mod
from pdserve.runtime import envs
from pdserve.runtime import lora_routes
from pdserve.runtime import metrics as metrics_mod
from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError, RequestStream
from pdserve.runtime.kv_event_publisher import KVEventPublisher
from pdserve.runtime.metrics import RequestTimer, ServerMetrics
from pdserve.runtime.outputs import RequestOutput
from pdserve.runtime.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, error_body, parse)
from pdserve.runtime.responses import ResponseBuilder
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.validation import InvalidParam, check_request, check_request_id, check_token_ids

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
MAX_BODY_BYTES = 32 * 2**20   # request bodies beyond this are refused (413) before being read into memory
MAX_JSON_DEPTH = 64           # nesting beyond this is refused (400): no OpenAI body comes close
TOKENIZE_THREADS = 2


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None
    max_waiting: int | None = None        # requests accepted but not started beyond this -> 503 + Retry-After
    role: str = "both"


class _State:
    def __init__(self, engine: Any, options: ServerOptions, metrics: ServerMetrics, async_engine: AsyncEngine):
        self.engine, self.options, self.metrics, self.async_engine = engine, options, metrics, async_engine
        self.draining = False
        self.model_names = {engine.served_model_name, str(getattr(engine.config.model, "model", None) or "")} - {""}
        self.vocab_size = int(engine.hf_config.vocab_size)
        self.created = int(time.time())
        # Tokenizing and chat-template rendering of a big prompt take seconds: off the event loop, so /health and
        # other requests keep being answered (a bounded pool: at most this many run at once).
        self.cpu_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)


def build_app(engine: Any, options: ServerOptions = ServerOptions(), *,
              kv_publisher: KVEventPublisher | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; the engine loop thread runs for the app's lifespan."""
    metrics = ServerMetrics(engine.served_model_name)
    metrics.set_model_weight_bytes(getattr(engine, "weight_bytes", 0))  # (test doubles of the engine have none)
    state = _State(engine, options, metrics, AsyncEngine(engine, metrics=metrics, kv_publisher=kv_publisher))
    builder = ResponseBuilder(engine)
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
    _install_error_handlers(app)

    def guard(request: Request) -> None:
        """API key and drain checks for the inference endpoints."""
        key = options.api_key
        if key:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        if state.draining:
            metrics.rejected("draining")
            raise ApiError(503, "server is shutting down", headers={"Retry-After": RETRY_AFTER_S,
                                                                    drain_mod.DRAIN_HEADER: "1"})
        if state.async_engine.dead is not None:
            raise ApiError(503, "engine is not running", headers={"Retry-After": RETRY_AFTER_S})

    guarded = [Depends(guard)]

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
        return {"object": "list", "data": [{
            "id": engine.served_model_name, "object": "model", "created": state.created, "owned_by": "pdserve",
            "root": str(getattr(engine.config.model, "model", None) or engine.served_model_name),
            "parent": None, "max_model_len": engine.max_model_len}, *lora_routes.model_cards(engine, state.created)]}

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = parse(TokenizeRequest, await _json(request))
        _check_model(state, req.model)
        if req.messages is not None:
            ids = await _chat_ids(state, [{"role": m.role, "content": m.text()} for m in req.messages],
                                  req.add_generation_prompt)
        else:
            ids = await state.off_loop(lambda: list(engine.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens)))
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = parse(DetokenizeRequest, await _json(request))
        _check_model(state, req.model)
        _check_token_ids(state, req.tokens, "tokens")
        return {"prompt": await state.off_loop(engine.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await _json(request))
        lora = _check_model(state, req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):  # tokenized as the engine does
            prompt_ids = await state.off_loop(lambda: list(engine.tokenizer.encode(prompt, add_special_tokens=False)))
        else:
            prompt_ids = list(prompt)
        prompt_ids, params = _checked(state, req, prompt_ids)
        return await _serve(request, state, builder, "completion", req, prompt_ids, params, lora)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await _json(request))
        lora = _check_model(state, req.model)
        prompt_ids = await _chat_ids(state, req.message_dicts(), req.add_generation_prompt)
        prompt_ids, params = _checked(state, req, prompt_ids)
        return await _serve(request, state, builder, "chat", req, prompt_ids, params, lora)

    lora_routes.install_routes(app, state, guarded, _json)
    return app


async def drain(app: FastAPI, grace_period_s: float) -> int:
    """Stop taking requests (503), wait up to ``grace_period_s`` for in-flight ones, abort the rest; returns how many
    were aborted. Aborted requests end with ``finish_reason="abort"`` so their clients still get a response."""
    state: _State = app.state.pdserve
    state.draining = True
    ae = state.async_engine
    deadline = time.monotonic() + grace_period_s
    while drain_mod.busy(state.engine, ae) and time.monotonic() < deadline:  # also leased KV (see runtime/drain.py)
        await asyncio.sleep(0.05)
    aborted = ae.abort_all()
    if aborted:
        logger.warning("grace period over: aborted %d in-flight request(s)", aborted)
    deadline = time.monotonic() + 5.0   # let aborted responses flush
    while ae.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return aborted


# ---- request helpers ----

async def _json(request: Request) -> Any:
    length = request.headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body must be at most {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body must be at most {MAX_BODY_BYTES} bytes")
    request.state.raw_body = data = bytes(raw)   # the KV handoff check MACs the exact bytes
    try:
        text = data.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, ints beyond 4300 digits
        raise ApiError(400, f"malformed JSON body: {str(e)[:200]}") from None
    _check_json_values(body, check_strings="\\u" in text)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_json_values(body: Any, check_strings: bool) -> None:
    """Nesting depth (deep bodies would overflow the stack of whatever walks them next) and, when the text had
    ``\\u`` escapes, lone surrogates (they cannot be tokenized or encoded back to UTF-8)."""
    todo = [(body, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ApiError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            todo += [(x, depth + 1) for kv in items for x in kv if isinstance(x, (dict, list, str))]
        elif check_strings and isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "malformed JSON body: a string holds a lone UTF-16 surrogate") from None


def _check_model(state: _State, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model); ApiError for an unknown model."""
    return lora_routes.resolve(state.engine, model, state.model_names)


def _check_token_ids(state: _State, ids: list[int], param: str) -> None:
    try:
        check_token_ids(ids, state.vocab_size, param)
    except InvalidParam as e:
        raise ApiError(400, str(e), param=param) from None


async def _chat_ids(state: _State, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    try:   # a template may refuse a conversation (TemplateError: e.g. roles out of order)
        return await state.off_loop(lambda: list(state.engine.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt)))
    except (ValueError, TypeError, TemplateError) as e:
        raise ApiError(400, f"cannot apply the chat template: {str(e)[:300]}", param="messages") from None


def _checked(state: _State, req: Any, prompt_ids: list[int]) -> tuple[list[int], SamplingParams]:
    """(prompt ids after ``truncate_prompt_tokens``, sampling params with the effective ``max_tokens``), checked by
    ``validation.check_request`` as the engine will check them (a 400 naming the request's field)."""
    if req.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-req.truncate_prompt_tokens:]
    params = req.sampling_params(req.token_limit())
    try:
        max_tokens = check_request(prompt_ids, params, state.engine.limits, priority=req.priority)
    except InvalidParam as e:
        raise req.api_error(e) from None
    return prompt_ids, params if params.max_tokens == max_tokens else replace(params, max_tokens=max_tokens)


def _request_id(request: Request, state: _State, body_id: str | None) -> tuple[str, str]:
    """(client-visible id, engine id): the engine id gets a suffix if a client reuses an id still in flight."""
    base = body_id or request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        check_request_id(base)   # the body's id was checked by parse; a header's is echoed back in one
    except InvalidParam as e:
        raise ApiError(400, f"X-Request-Id header: {e}", param="request_id") from None
    rid = base
    while state.async_engine.is_inflight(rid):
        rid = f"{base}-{uuid.uuid4().hex[:8]}"
    return base, rid


async def _serve(request: Request, state: _State, builder: ResponseBuilder, kind: str, req: Any,
                 prompt_ids: list[int], params: SamplingParams, lora: str | None = None) -> Response:
    ae, metrics = state.async_engine, state.metrics
    max_waiting = state.options.max_waiting
    if max_waiting is not None and ae.num_unstarted >= max_waiting:
        metrics.rejected("queue_full")
        raise ApiError(503, f"server overloaded: {ae.num_unstarted} requests waiting (limit {max_waiting})",
                       headers={"Retry-After": RETRY_AFTER_S})
    _check_kv_handoff(request, state, req.kv_transfer_params)
    base_id, rid = _request_id(request, state, req.request_id)
    arrival = time.monotonic()
    try:
        stream = await ae.add(rid, prompt_ids, params, priority=req.priority, cache_salt=req.cache_salt,
                              kv_transfer_params=req.kv_transfer_params, arrival_time=time.time(),
                              **({"lora_name": lora} if lora is not None else {}))
    except KeyError as e:   # LoRANotFound: the adapter was unloaded since the request was checked
        raise ApiError(404, str(e), param="model", code="model_not_found") from None
    except InvalidParam as e:
        raise req.api_error(e) from None
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None
    resp_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}"
    trace = tracing.request_trace(request.headers, state.options.role, state.engine, base_id, params,
                                  req.kv_transfer_params)   # None while tracing is off
    timer = RequestTimer(metrics, arrival, trace)
    headers = {"X-Request-Id": base_id}
    if req.stream:
        gen = _stream_events(builder, kind, req, resp_id, prompt_ids, stream, timer)
        return _EngineStreamResponse(gen, state, stream, media_type="text/event-stream", headers=headers)
    try:
        final = await _await_final(request, state, stream, timer)
    finally:
        ae.release(stream)
    if final is not None and any(c.finish_reason == "error" for c in final.outputs):
        raise ApiError(503, f"request failed in the engine: {final.error or 'unknown error'}",
                       code="engine_error", headers={"Retry-After": RETRY_AFTER_S})
    body = builder.full(kind, req, resp_id, prompt_ids, final)
    return JSONResponse(body, headers=headers)


def _check_kv_handoff(request: Request, state: _State, params: Any) -> None:
    """403 unless a request asking this pod to hold its blocks for a remote decode comes from the deployment's router
    (its KV-secret handoff header) or carries the pod's API key (checked by ``guard``); see kv_connectors/kv_auth."""
    conn = getattr(state.engine, "connector", None)
    if conn is None or not kv_auth.wants_handoff(params):
        return
    denial = kv_auth.handoff_denial(getattr(conn, "secret", None), request.headers.get(kv_auth.HANDOFF_HEADER),
                                    getattr(request.state, "raw_body", b""), api_key_ok=bool(state.options.api_key))
    if denial:
        conn.stats.add("kv_handoffs_rejected")
        raise ApiError(403, denial, param="kv_transfer_params", code="kv_handoff_unauthorized")


async def _await_final(request: Request, state: _State, stream: RequestStream,
                       timer: RequestTimer) -> RequestOutput | None:
    """The finished output (``None`` if the server aborted it before any output); a client that disconnects first
    gets its request aborted (by the caller's ``release``)."""

    async def final() -> RequestOutput | None:
        last = None
        while True:
            out = await stream.next()
            timer.update(out)
            if out is None or out.finished:
                return out or last
            last = out

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, watcher = asyncio.ensure_future(final()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():
            result.cancel()
    if not result.done() or result.cancelled():
        state.metrics.aborted_disconnect.inc()
        raise ApiError(499, "client disconnected")
    try:
        return result.result()
    except EngineDeadError as e:
        raise ApiError(503, str(e), headers={"Retry-After": RETRY_AFTER_S}) from None


class _EngineStreamResponse(StreamingResponse):
    """SSE response that releases its engine request however it ends: completed, client gone (the body task is
    cancelled, possibly before the generator ever ran), or an error while sending."""

    def __init__(self, content: AsyncIterator[str], state: _State, stream: RequestStream, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._state, self._stream = state, stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._state.metrics.aborted_disconnect.inc()
            self._state.async_engine.release(self._stream)


async def _stream_events(builder: ResponseBuilder, kind: str, req: Any, resp_id: str, prompt_ids: list[int],
                         stream: RequestStream, timer: RequestTimer) -> AsyncIterator[str]:
    """SSE frames for one request, ending with ``data: [DONE]`` (errors are sent as an error event first)."""
    chunker = builder.chunker(kind, req, resp_id, prompt_ids)
    for chunk in chunker.start():
        yield _sse(chunk)
    while True:
        try:
            out = await stream.next()
        except EngineDeadError as e:
            yield _sse(error_body(str(e), "service_unavailable_error"))
            break
        timer.update(out)
        if out is not None and any(c.finish_reason == "error" for c in out.outputs):
            yield _sse(error_body(f"request failed in the engine: {out.error or 'unknown error'}",
                                  "service_unavailable_error", code="engine_error"))
            break
        for chunk in chunker.update(out):
            yield _sse(chunk)
        if out is None or out.finished:
            break
    yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
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


# ---- process entry point ----

class _GracefulServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains (see ``drain``) before exiting 0; a second one exits now."""

    def __init__(self, app: FastAPI, config: Any, grace_period_s: float):
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:  # runs in the main thread between bytecodes
                if outer.draining:
                    self.should_exit = self.force_exit = True
                    return
                outer.draining = True
                logger.info("signal %d: draining for up to %.0fs", sig, grace_period_s)
                outer.loop.call_soon_threadsafe(outer.start_drain)

        self.app, self.grace_period_s, self.draining = app, grace_period_s, False
        self.server = Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None

    def start_drain(self) -> None:
        task = asyncio.ensure_future(drain(self.app, self.grace_period_s))
        task.add_done_callback(lambda _: setattr(self.server, "should_exit", True))

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()


def run_server(args: Any) -> int:
    """``pdserve serve``: build the engine (and KV event publisher) from the parsed flags and serve until signalled."""
    from pdserve.runtime.cli import engine_options
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_options(**engine_options(args)))
    try:
        lora_routes.register_modules(engine, getattr(args, "lora_modules", None))
    except ValueError:
        engine.shutdown()
        raise
    publisher = None
    if args.kv_events_port:
        publisher = KVEventPublisher(args.kv_events_host, args.kv_events_port,
                                     replay_port=args.kv_events_replay_port or None, topic=args.kv_events_topic)
    options = ServerOptions(api_key=args.api_key or envs.api_key(), max_waiting=args.max_waiting, role=args.role)
    return serve_engine(engine, host=args.host, port=args.port, options=options, kv_publisher=publisher,
                        shutdown_grace_period=args.shutdown_grace_period, log_level=args.log_level)


def serve_engine(engine: Any, *, host: str, port: int, options: ServerOptions,
                 kv_publisher: KVEventPublisher | None, shutdown_grace_period: float, log_level: str = "info") -> int:
    """Serve ``engine`` until SIGTERM/SIGINT, then drain and return 0. Owns and shuts down the engine and publisher."""
    import uvicorn

    app = build_app(engine, options, kv_publisher=kv_publisher)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = _GracefulServer(app, config, shutdown_grace_period)
    try:
        asyncio.run(server.serve())
    finally:
        if kv_publisher is not None:
            kv_publisher.close()
        engine.shutdown()
    return 0 if server.server.started or server.draining else 1
