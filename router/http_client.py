"""A lean pooled HTTP/1.1 client for the proxy hot path (httptools response parser on asyncio/uvloop).

Why not aiohttp here: per request it costs the router more CPU than everything else it does; this client writes each
request in one ``write``, parses with httptools, and keeps idle keep-alive connections per pod. Contract:

- ``Pool.request(method, url, body, headers)`` returns a ``Response`` once the status line and headers arrived, or
  raises ``ConnectError`` (could not connect / connection refused), ``ProtocolError`` (the pod closed or sent garbage
  before the headers) or ``asyncio.TimeoutError`` (``connect_timeout`` to connect, ``timeout`` for the whole request).
- The caller reads the body (``read()`` or ``async for chunk in resp.iter_chunks()``) and then calls ``release()``:
  a fully read keep-alive response returns its connection to the pool; anything else closes it, so a cancelled
  request is seen by the pod as a disconnect (and aborted there).
- A connection taken from the pool that turns out dead before any response byte (the pod closed it while idle) is
  retried once on a fresh connection (safe: the pod never saw the request).
- Framing: 1xx interim answers are skipped; a body without Content-Length or chunked encoding ends at the close;
  ambiguous framing (httptools' strict parser), headers over ``MAX_HEADER_BYTES`` and bytes nobody asked for fail the
  connection (tests/router/test_router_http_client.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit

import httptools


MAX_HEADER_BYTES = 64 * 1024


class ConnectError(OSError):
    pass


class ProtocolError(OSError):
    pass


class Response:
    __slots__ = ("conn", "status", "headers", "_chunks", "_eof", "_error", "_waiter", "_released")

    def __init__(self, conn: "_Conn"):
        self.conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._released = False

    def is_eof(self) -> bool:
        return self._eof and not self._chunks

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _next(self) -> bytes | None:
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._eof:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = self.conn.loop.create_future()
            self.conn.transport.resume_reading()
            await self._waiter
            self._waiter = None

    async def iter_chunks(self):
        """Body chunks as they arrive (chunked framing already removed)."""
        while (chunk := await self._next()) is not None:
            yield chunk

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._next()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.conn.finish(reuse=self.is_eof() and self._error is None)


class _Conn(asyncio.Protocol):
    def __init__(self, pool: "Pool", key: tuple[str, int]):
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.headers_ready: asyncio.Future | None = None
        self.keep_alive = True
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.got_bytes = False
        self.header_bytes = 0

    # -- transport ----------------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        r = self.resp
        if (exc is None and r is not None and r.status and not r._eof and "content-length" not in r.headers
                and "transfer-encoding" not in r.headers):
            r._eof = True  # a body delimited by the connection's close (RFC 9112 6.3, last rule) ended cleanly
            r._wake()
            return
        err = ProtocolError(f"connection to {self.key[0]}:{self.key[1]} lost" + (f": {exc}" if exc else ""))
        self._fail(err)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ProtocolError(f"bad HTTP response from {self.key[0]}:{self.key[1]}: {e}"))
            self.transport.close()
            return
        r = self.resp
        if r is not None and len(r._chunks) > 64:  # the client reads slower than the pod writes: back-pressure
            self.transport.pause_reading()

    def _fail(self, err: BaseException) -> None:
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(err)
        r = self.resp
        if r is not None and not r._eof and r._error is None:
            r._error = err
            r._wake()

    # -- parser -------------------------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.resp is None or self.resp.status:  # bytes nobody asked for (after a response, or while idle)
            raise ProtocolError("unsolicited response")
        self.header_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise ProtocolError("response headers too large")
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx informational: the real answer follows (its headers are not the response's)
            self.resp.headers.clear()
            return
        self.resp.status = status
        self.keep_alive = self.parser.should_keep_alive()
        if not self.headers_ready.done():
            self.headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.resp._chunks.append(body)
        self.resp._wake()

    def on_message_complete(self) -> None:
        if not self.resp.status:  # the end of a 1xx
            return
        self.resp._eof = True
        self.resp._wake()

    # -- use ----------------------------------------------------------------------------------------------------------
    def start(self, payload: bytes, deadline: float) -> Response:
        self.resp = Response(self)
        self.headers_ready = self.loop.create_future()
        self.got_bytes = False
        self.timer = self.loop.call_at(deadline, self._timeout)
        self.transport.write(payload)
        return self.resp

    def _timeout(self) -> None:
        self._fail(asyncio.TimeoutError())
        self.transport.abort()

    def finish(self, reuse: bool) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        idle = self.pool._idle.setdefault(self.key, [])
        if reuse and self.keep_alive and not self.closed and len(idle) < self.pool.max_idle:
            self.resp = None
            idle.append(self)
        else:
            self.closed = True
            self.transport.close()


class Pool:
    def __init__(self, connect_timeout: float = 5.0, timeout: float = 600.0, max_idle_per_host: int = 256):
        self.connect_timeout, self.timeout, self.max_idle = connect_timeout, timeout, max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(self, key), key[0], key[1]),
                                             self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as e:  # (a connect timeout: the pod never saw the request)
            raise ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e or 'timed out'}") from None
        return conn

    async def request(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> Response:
        u = urlsplit(url)
        key = (u.hostname or "127.0.0.1", u.port or 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = [f"{method} {target} HTTP/1.1\r\nhost: {u.netloc}\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n")
        if body is not None:
            head.append(f"content-length: {len(body)}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1") + (body or b"")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        for attempt in (0, 1):
            idle = self._idle.get(key)
            conn = None
            while idle:
                c = idle.pop()
                if not c.closed:
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            resp = conn.start(payload, deadline)
            try:
                await conn.headers_ready
            except ProtocolError:
                conn.finish(reuse=False)
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # a stale pooled connection: the pod never saw this request
                raise
            except BaseException:
                conn.finish(reuse=False)
                raise
            return resp
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.transport.close()
        self._idle.clear()
