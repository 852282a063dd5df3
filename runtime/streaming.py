"""Reading one request's outputs off its ``RequestStream``: the whole final output (non-streaming) or SSE frames shaped
like OpenAI's (``data: {...}`` per chunk, ``data: [DONE]`` last). However the client goes away, its engine request is
released (aborted if unfinished), so its blocks are freed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pdserve.runtime.async_engine import EngineDeadError, RequestStream
from pdserve.runtime.metrics import RequestTimer
from pdserve.runtime.outputs import RequestOutput
from pdserve.runtime.protocol import RETRY_AFTER_S, ApiError, SamplingRequest, error_body
from pdserve.runtime.responses import ResponseBuilder
from pdserve.runtime.server_state import ServerState
from pdserve.runtime.structured_output.manager import DEAD_END


def engine_failed(out: RequestOutput | None) -> bool:
    return out is not None and any(c.finish_reason == "error" for c in out.outputs)


def constraint_dead_end(out: RequestOutput) -> bool:
    """The request's constraint reached a state no token of the vocabulary continues: the client's fault (400)."""
    return (out.error or "").startswith(DEAD_END)


async def await_final(request: Request, state: ServerState, stream: RequestStream,
                      timer: RequestTimer) -> RequestOutput | None:
    """The finished output (``None`` if the server aborted it before any output); a client that disconnects first
    gets a 499 and its request aborted (by the caller's ``release``)."""

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


class EngineStreamResponse(StreamingResponse):
    """SSE response that releases its engine request however it ends: completed, client gone (the body task is
    cancelled, possibly before the generator ever ran), or an error while sending."""

    def __init__(self, content: AsyncIterator[str], state: ServerState, stream: RequestStream, **kwargs: Any):
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._state, self._stream = state, stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._state.metrics.aborted_disconnect.inc()
            self._state.async_engine.release(self._stream)


async def sse_events(builder: ResponseBuilder, kind: str, req: SamplingRequest, resp_id: str, prompt_ids: list[int],
                     stream: RequestStream, timer: RequestTimer) -> AsyncIterator[str]:
    """SSE frames for one request, ending with ``data: [DONE]`` (errors are sent as an error event first)."""
    chunker = builder.chunker(kind, req, resp_id, prompt_ids)
    for chunk in chunker.start():
        yield sse(chunk)
    while True:
        try:
            out = await stream.next()
        except EngineDeadError as e:
            yield sse(error_body(str(e), "service_unavailable_error"))
            break
        timer.update(out)
        if engine_failed(out):
            if constraint_dead_end(out):
                yield sse(error_body(out.error, "invalid_request_error", code="structured_output_dead_end"))
            else:
                yield sse(error_body(f"request failed in the engine: {out.error or 'unknown error'}",
                                     "service_unavailable_error", code="engine_error"))
            break
        for chunk in chunker.update(out):
            yield sse(chunk)
        if out is None or out.finished:
            break
    yield "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
