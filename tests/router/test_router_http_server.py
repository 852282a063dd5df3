"""The router's minimal HTTP/1.1 server over raw sockets: keep-alive, pipelining, chunked request bodies, chunked
streaming responses, malformed requests (400), oversized headers (431), and the read/idle timeout."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdserve.router.http_server import Server
from tests.router.asgi_echo import STREAM_PIECE, echo_app, echo_line, serve_lifespan


@pytest.fixture
async def server():
    srv = Server(echo_app, "127.0.0.1", 0, keep_alive_timeout=0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        srv.port = s.getsockname()[1]
    task = asyncio.create_task(srv.serve(install_signals=False))
    await asyncio.wait_for(srv.started.wait(), 10)
    yield srv
    srv.stop()
    await asyncio.wait_for(task, 10)


async def exchange(port: int, data: bytes, until: bytes | None = None, timeout: float = 5.0) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    out = b""
    try:
        while until is None or until not in out:
            chunk = await asyncio.wait_for(r.read(65536), timeout)
            if not chunk:
                break
            out += chunk
    finally:
        w.close()
    return out


async def test_keep_alive_pipelining_and_chunked_bodies(server):
    req = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
           b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    a, b = echo_line("POST", "/a", b"hello"), echo_line("POST", "/b", b"abcde")
    out = await exchange(server.port, req, until=b)
    assert out.count(b"HTTP/1.1 200 OK") == 2
    assert out.index(a) < out.index(b) and out.endswith(b)


async def test_streamed_response_is_chunked(server):
    out = await exchange(server.port, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", until=b"0\r\n\r\n")
    echo = echo_line("GET", "/stream", b"")
    pieces = [echo[i:i + STREAM_PIECE] for i in range(0, len(echo), STREAM_PIECE)]
    assert b"transfer-encoding: chunked" in out and out.endswith(
        b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n")


async def test_bad_requests_and_timeouts(server):
    out = await exchange(server.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400") and b'"error"' in out
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"
    assert (await exchange(server.port, big)).startswith(b"HTTP/1.1 431")
    # a request that never completes is closed after the read timeout (0.5 s here), with no response
    out = await exchange(server.port, b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    assert out == b""
    # Connection: close is honoured
    out = await exchange(server.port, b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b"connection: close" in out and out.endswith(b"\r\n\r\n" + echo_line("GET", "/c", b""))


async def reject_early_app(scope, receive, send):
    """Answers 413 from the headers alone, never reading the body (as the router does for oversized requests)."""
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    body = b'{"error": "too large"}'
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def test_early_answer_says_connection_close_and_still_reaches_the_client():
    # The server answers 413 from the headers alone, before the body arrives, and then closes the connection: the
    # response must say so (else a keep-alive client reuses the dying connection and loses its next request), and the
    # close must not be an RST that destroys the response (input arriving after the answer is discarded).
    srv = Server(reject_early_app, "127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        srv.port = s.getsockname()[1]
    task = asyncio.create_task(srv.serve(install_signals=False))
    await asyncio.wait_for(srv.started.wait(), 10)
    try:
        def client() -> bytes:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n")
                time.sleep(0.3)                  # the server has answered
                try:
                    c.sendall(b"x" * 65536)
                except OSError:
                    pass
                out = b""
                while chunk := c.recv(65536):
                    out += chunk
                return out

        out = await asyncio.to_thread(client)
        assert out.startswith(b"HTTP/1.1 413") and out.endswith(b'{"error": "too large"}')
        assert b"connection: close\r\n" in out.lower()
    finally:
        srv.stop()
        await asyncio.wait_for(task, 10)
