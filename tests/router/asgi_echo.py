"""The ASGI pieces the router's HTTP tests share: lifespan handling, reading a request body, and one echo app that
answers ``echo_line(method, path, body)`` (plus a few paths that misbehave on purpose) for framing tests."""

from __future__ import annotations

import asyncio
import hashlib


async def serve_lifespan(receive, send) -> None:
    """Answer lifespan startup/shutdown until shutdown."""
    while True:
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return


async def read_body(receive) -> bytes | None:
    """The whole request body, or None when the client went away first."""
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


def echo_line(method: str, path: str, body: bytes) -> bytes:
    """What the echo app answers: ``METHOD PATH sha256(body)[:16] len`` + the body."""
    return b"%s %s %s %d\n" % (method.encode(), path.encode(), hashlib.sha256(body).hexdigest()[:16].encode(),
                               len(body)) + body


STREAM_PIECE = 7   # /stream sends the echo in pieces of this many bytes, one chunk each


async def echo_app(scope, receive, send):
    """Echo (``echo_line``); ``/stream`` streams it chunked; ``/wrong-length-*``, ``/split-header``, ``/later`` and
    ``/raise`` misbehave on purpose."""
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    body = await read_body(receive)
    if body is None:
        return
    path = scope["path"]
    if path == "/wrong-length-long":  # declares 5, sends 11
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello world"})
        return
    if path == "/wrong-length-short":  # declares 50, sends 5
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"50")]})
        await send({"type": "http.response.body", "body": b"hello"})
        return
    if path == "/split-header":  # a header value with CR/LF must not reach the wire
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-id", b"a\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK"),
                                (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if path == "/later":  # answers after a while (the client may have half-closed meanwhile)
        await asyncio.sleep(0.3)
    if path == "/raise":
        raise RuntimeError("app bug")
    out = echo_line(scope["method"], path, body)
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(0, len(out), STREAM_PIECE):
            await send({"type": "http.response.body", "body": out[i:i + STREAM_PIECE], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})
