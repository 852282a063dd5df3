"""Raw-ASGI response helpers: JSON bodies and OpenAI-shaped errors ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

Send = Callable[[dict], Awaitable[None]]

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               429: "rate_limit_error", 502: "upstream_error", 503: "service_unavailable", 504: "timeout_error"}


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes = b"application/json",
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())] + (extra or [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, json.dumps(obj).encode(), extra=extra)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


async def send_error(send: Send, status: int, message: str, *, param: str | None = None, code: str | None = None,
                     retry_after: float | None = None, request_id: str | None = None) -> None:
    extra = []
    if retry_after is not None:
        extra.append((b"retry-after", str(max(1, int(retry_after))).encode()))
    if request_id:
        extra.append((b"x-request-id", request_id.encode()))
    await send_json(send, status, error_body(status, message, param, code), extra)
