"""A minimal HTTP/1.1 server for the router's ASGI app (httptools parser on asyncio/uvloop).

Why not uvicorn: on a loaded host each socket write to loopback costs tens of microseconds, and uvicorn writes the
status line + headers and the body of every response separately. This server holds the head back until the first
body chunk, so a JSON response goes out in one write, and a streamed (chunked) response costs one write per chunk.
It implements the subset of ASGI 3 the router needs: ``http`` scopes (keep-alive, pipelining handled one request at a
time, request bodies by content-length or chunked), ``http.disconnect`` on connection loss, ``lifespan``, write
back-pressure, a keep-alive/read timeout (an idle connection, or one whose request does not fully arrive in time, is
closed) and a header-size limit (431). ``serve`` stops on SIGINT/SIGTERM: it stops
accepting, lets in-flight requests finish for up to ``drain_timeout`` seconds, then runs lifespan shutdown.

Framing rules (proved by tests/router/test_router_http_conformance.py, raw sockets + hypothesis): requests whose
framing is ambiguous (Content-Length with Transfer-Encoding, conflicting lengths, codings other than a final chunked,
bad chunks, obs-fold, bare LF) are refused by httptools' strict parser with a 400 and the connection closed; HTTP/2+
request lines get 505. Response framing belongs to this server, not the app: it writes Content-Length /
Transfer-Encoding / Connection itself, cuts a body longer than its declared length and closes after a shorter one (so
a wrong length can never desynchronize a keep-alive connection), refuses header values that would split the response,
sends no body to HEAD, answers ``Expect: 100-continue`` when the app reads the body, and answers a half-closed client
(FIN after its requests) before closing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from collections import deque
from typing import Any, Callable

import httptools

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
LINGER_SECONDS = 2.0  # how long a connection answered before its request ended may keep discarding input
REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
           408: b"Request Timeout", 413: b"Payload Too Large", 429: b"Too Many Requests", 431: b"Request Header Fields "
           b"Too Large", 500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable",
           504: b"Gateway Timeout", 505: b"HTTP Version Not Supported"}


INTERNAL_ERROR = b'{"error": {"message": "internal error", "type": "server_error", "param": null, "code": null}}'
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _check_header(name: bytes, value: bytes) -> None:
    """A response header the app sets must not be able to split the response (CR/LF) or break the framing."""
    if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
        raise ValueError(f"invalid response header {name!r}: {value[:64]!r}")


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Status"))


class _Cycle:
    """One request/response exchange: the ASGI ``receive``/``send`` pair."""

    __slots__ = ("conn", "scope", "body", "more_body", "event", "disconnected", "started", "complete", "head",
                 "chunked", "keep_alive", "request_done", "remaining", "expect_continue")

    def __init__(self, conn: "_Connection", scope: dict, keep_alive: bool):
        self.conn, self.scope, self.keep_alive = conn, scope, keep_alive
        self.body: list[bytes] = []
        self.more_body = True
        self.event = asyncio.Event()
        self.disconnected = self.started = self.complete = self.chunked = self.request_done = False
        self.head: bytes | None = None
        self.remaining = -1  # body bytes the declared content-length still owes (-1: chunked)
        self.expect_continue = False  # the client waits for "100 Continue" before it sends the body

    async def receive(self) -> dict:
        """The request body (in chunks), then - once it is all delivered - block until the client disconnects or
        the response is complete, and report ``http.disconnect``."""
        while True:
            if self.disconnected or self.complete:
                return {"type": "http.disconnect"}
            if self.expect_continue:  # the app wants the body: invite it (an app answering from the headers doesn't)
                self.expect_continue = False
                if not self.started and self.more_body:
                    self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if not self.request_done and (self.body or not self.more_body):
                data = b"".join(self.body)
                self.body.clear()
                self.request_done = not self.more_body
                if self.more_body:
                    self.conn.transport.resume_reading()
                return {"type": "http.request", "body": data, "more_body": self.more_body}
            self.event.clear()
            await self.event.wait()

    async def send(self, msg: dict) -> None:
        if self.disconnected:
            return
        kind = msg["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("response already started")
            parts = [_status_line(msg["status"])]
            length = -1
            for name, value in msg.get("headers", ()):
                lname = name.lower()
                if lname in (b"content-length", b"transfer-encoding", b"connection"):
                    # framing is this server's: it writes these itself, consistently with the body it sends
                    if lname == b"content-length" and value.strip().isdigit() and length < 0:
                        length = int(value)
                    elif lname == b"connection" and value.strip().lower() == b"close":
                        self.keep_alive = False
                    continue
                _check_header(name, value)
                parts.append(b"%s: %s\r\n" % (name, value))
            self.started = True
            self.remaining = length
            if length >= 0:
                parts.append(b"content-length: %d\r\n" % length)
            else:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            if self.conn.parsing is self:  # answered before the body arrived: the connection closes after it
                self.keep_alive = False
            if not self.keep_alive:
                parts.append(b"connection: close\r\n")
            parts.append(b"\r\n")
            self.head = b"".join(parts)
            return
        if kind != "http.response.body" or not self.started or self.complete:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        body, more = msg.get("body", b""), msg.get("more_body", False)
        if self.chunked:
            out = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                out += b"0\r\n\r\n"
        else:
            # The framing must match what the head declared, whatever the app does: a body longer than its
            # content-length is cut (the excess would be read as the next response), a shorter one ends the
            # connection (the client sees a truncated message, never a desynchronized stream).
            if len(body) > self.remaining:
                log.error("ASGI app sent %d body bytes past its content-length", len(body) - self.remaining)
                body, more = body[:self.remaining], False
            self.remaining -= len(body)
            if not more and self.remaining:
                log.error("ASGI app ended its response %d bytes short of its content-length", self.remaining)
                self.keep_alive = False
            out = body
        if self.scope["method"] == "HEAD":  # the head says how long the body would be; a HEAD answer has none
            out = b""
        if self.head is not None:
            out, self.head = self.head + out, None
        if out:
            self.conn.transport.write(out)
        if not more:
            self.complete = True
            self.event.set()
            if not self.chunked and self.remaining:
                self.conn.transport.close()
            self.conn.on_response_complete(self)
        elif self.conn.write_paused:
            await self.conn.drained()


class _Connection(asyncio.Protocol):
    def __init__(self, server: "Server"):
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending: deque[_Cycle] = deque()   # parsed, waiting for the current one to finish (pipelining)
        self.current: _Cycle | None = None
        self.parsing: _Cycle | None = None      # the cycle whose body is still arriving
        self.refusal: tuple[int, bytes] | None = None  # why a parser callback stopped the parse
        self.lingering = False                  # answered and closing: the rest of the input is discarded
        self.half_closed = False                # the client sent FIN: answer what arrived, then close
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.write_paused = False
        self._drain: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None

    # -- transport callbacks ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for c in [self.current, self.parsing, *self.pending]:
            if c is not None:
                c.disconnected = True
                c.event.set()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if self._idle is not None:
            self._idle.cancel()

    def eof_received(self) -> bool:
        """The client half-closed its side (``shutdown(SHUT_WR)``): it can still read. Requests that arrived whole are
        answered before the connection closes; a request cut off by the FIN will never complete, so that closes now."""
        self.half_closed = True
        if self.lingering:
            return False
        if self.parsing is not None or (self.current is None and not self.pending):
            return False  # (returning False lets the transport close itself)
        return True

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        if self.write_paused:
            self._drain = self.loop.create_future()
            await self._drain

    def data_received(self, data: bytes) -> None:
        # (the idle timer keeps running until a whole request has arrived: it also bounds slow request reads)
        if self.lingering:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"upgrades are not supported")
        except httptools.HttpParserError:
            self._reject(*(self.refusal or (400, b"malformed HTTP request")))

    def _reject(self, status: int, text: bytes) -> None:
        body = b'{"error": {"message": "%s", "type": "invalid_request_error", "param": null, "code": null}}' % text
        self.transport.write(_status_line(status) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(body), body))
        self._linger_close()

    def _linger_close(self) -> None:
        """Close a connection whose request was not read to the end. A plain close with unread input makes the kernel
        send RST, which can destroy the response before the client has read it; so send FIN after the response,
        discard whatever still arrives, and close when the client does or after LINGER_SECONDS."""
        self.lingering = True
        self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _arm_idle(self) -> None:
        self._idle = self.loop.call_later(self.server.keep_alive_timeout, self.transport.close)

    # -- parser callbacks -----------------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url, self.headers, self.header_bytes = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.header_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            self.refusal = (431, b"request headers too large")
            raise ValueError("request headers too large")
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in ("1.1", "1.0"):
            self.refusal = (505, b"HTTP version not supported")
            raise ValueError("unsupported HTTP version")
        parsed = httptools.parse_url(self.url)
        path = parsed.path.decode("latin-1")
        host, port = self.transport.get_extra_info("sockname")[:2]
        peer = self.transport.get_extra_info("peername")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": self.parser.get_http_version(), "method": self.parser.get_method().decode("ascii"),
                 "scheme": "http", "path": path, "raw_path": parsed.path, "query_string": parsed.query or b"",
                 "root_path": "", "headers": self.headers, "server": (host, port),
                 "client": peer[:2] if peer else None}
        cycle = _Cycle(self, scope, self.parser.should_keep_alive())
        cycle.expect_continue = (b"expect", b"100-continue") in [(k, v.lower()) for k, v in self.headers]
        self.parsing = cycle
        if self.current is None:
            self._start(cycle)
        else:
            self.pending.append(cycle)
            self.transport.pause_reading()

    def on_body(self, body: bytes) -> None:
        c = self.parsing
        if c is not None:
            c.body.append(body)
            c.event.set()
            if sum(map(len, c.body)) > 1 << 20:  # the app reads slower than the client sends: back-pressure
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        c = self.parsing
        if c is not None:
            c.more_body = False
            c.event.set()
        self.parsing = None

    # -- request lifecycle ---------------------------------------------------------------------------------------------
    def _start(self, cycle: _Cycle) -> None:
        self.current = cycle
        self.server.tasks.add(task := self.loop.create_task(self._run(cycle)))
        task.add_done_callback(self.server.tasks.discard)

    async def _run(self, cycle: _Cycle) -> None:
        try:
            await self.app(cycle.scope, cycle.receive, cycle.send)
        except Exception:  # noqa: BLE001 (never let one request kill the connection handler)
            log.exception("unhandled error in the ASGI app")
            if not cycle.started and not cycle.disconnected:
                await cycle.send({"type": "http.response.start", "status": 500,
                                  "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", b"%d" % len(INTERNAL_ERROR))]})
                await cycle.send({"type": "http.response.body", "body": INTERNAL_ERROR})
        if not cycle.complete and not cycle.disconnected:
            self.transport.close()  # the app ended without finishing its response

    def on_response_complete(self, cycle: _Cycle) -> None:
        self.current = None
        if self.parsing is cycle:  # answered before the whole body arrived (the response said so)
            self._linger_close()
            return
        if not cycle.keep_alive or self.server.stopping or (self.half_closed and not self.pending):
            self.transport.close()
            return
        if self.pending:
            self._start(self.pending.popleft())
        if not self.pending:
            self.transport.resume_reading()
        if self.current is None:
            self._arm_idle()


class Server:
    def __init__(self, app: Callable, host: str, port: int, *, keep_alive_timeout: float = 75.0,
                 drain_timeout: float = 30.0):
        self.app, self.host, self.port = app, host, port
        self.keep_alive_timeout, self.drain_timeout = keep_alive_timeout, drain_timeout
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.stopping = False
        self.started = asyncio.Event()
        self._stop = asyncio.Event()
        self._lifespan_in: asyncio.Queue = asyncio.Queue()
        self._lifespan_out: asyncio.Queue = asyncio.Queue()

    def stop(self) -> None:
        self._stop.set()

    async def _lifespan(self, phase: str) -> None:
        await self._lifespan_in.put({"type": f"lifespan.{phase}"})
        msg = await self._lifespan_out.get()
        if msg["type"].endswith(".failed"):
            raise RuntimeError(f"lifespan {phase} failed: {msg.get('message', '')}")

    async def serve(self, install_signals: bool = True) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        life = asyncio.create_task(self.app(scope, self._lifespan_in.get, self._lifespan_out.put))
        await self._lifespan("startup")
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(self), self.host, self.port, backlog=2048,
                                          reuse_address=True)
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.stop)
        self.started.set()
        try:
            await self._stop.wait()
        finally:
            self.stopping = True
            server.close()
            for c in list(self.connections):
                if c.current is None:
                    c.transport.close()
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=self.drain_timeout)
            for c in list(self.connections):
                c.transport.close()
            await self._lifespan("shutdown")
            await life


def run(app: Any, host: str, port: int) -> None:
    """Serve ``app`` until SIGINT/SIGTERM, on uvloop when it is installed."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(Server(app, host, port).serve())
