"""A mutually authenticated request/response side channel: length-prefixed msgpack frames over TCP. No pickle.

One short connection per call, three frames (protocol v2):

1. server -> client  ``{"v": 2, "nonce": Ns, "engine_id": E}``
2. client -> server  ``{"req": R, "nonce": Nc, "from": C, "mac": HMAC(K, "c2s", Ns, Nc, S, C, R)}``
3. server -> client  ``{"res": A, "mac": HMAC(K, "s2c", Ns, Nc, S, C, [R, A])}``

``K`` is the deployment's KV secret, ``R``/``A`` the msgpack bytes of ``[op, body]`` and of the answer, ``C`` the
client's engine id and ``S = "<server engine id>@<host>:<port>"``: the server's identity *as the client believes it*
(the engine id and address from the signed ``kv_transfer_params``), which the server checks against its own advertised
identity. So the secret never crosses the wire, each side proves knowledge of it over both fresh nonces (no replay in
either direction), and a relay fails: a client talking to a relay binds the relay's address into its MAC, which the
real server rejects, and no one without ``K`` can forge the server's answer (``meta``, the ``done`` verdict).

Every socket wait has a timeout and each connection an overall deadline; frames are capped; at most
``max_connections`` connections are served at once (more are closed at once and counted), so a flood of idle
connections cannot grow threads without bound.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from pdserve.kv_connectors.load_errors import LoadTimeout, PeerUnreachable, logger

VERSION = 2
MAX_FRAME = 16 << 20          # answers (agent metadata) the client accepts
MAX_REQUEST_FRAME = 4 << 20   # requests the server accepts
_LEN = struct.Struct(">I")


class SideChannelError(PeerUnreachable):
    """The peer answered with an error, failed authentication, or its answer did not authenticate."""


def identity(engine_id: str, host: str, port: int) -> str:
    """How a server is named in MACs: its engine id and the address its peers dial."""
    return f"{engine_id}@{host}:{port}"


def _mac(token: bytes, direction: str, nonce_s: bytes, nonce_c: bytes, server: str, client: str, payload: Any) -> bytes:
    msg = msgpack.packb(["pdserve-kv-side-channel", VERSION, direction, nonce_s, nonce_c, server, client, payload],
                        use_bin_type=True)
    return hmac.new(token, msg, hashlib.sha256).digest()


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("connection deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, deadline: float, limit: int = MAX_FRAME) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes exceeds {limit}")
    return msgpack.unpackb(_recv_exact(sock, n, deadline), raw=False)


def _nonce_ok(v: Any) -> bool:
    return isinstance(v, bytes) and 16 <= len(v) <= 64


class SideChannelServer:
    """Serves ``handler(op, body) -> dict`` on ``host:port`` (port 0: the OS picks; see ``.port``) as the engine
    ``engine_id`` reachable at ``advertise_host:port``."""

    def __init__(self, host: str, port: int, token: bytes, handler: Callable[[str, dict], dict],
                 timeout: float = 5.0, on_auth_failure: Callable[[], None] | None = None, *,
                 engine_id: str = "pdserve", advertise_host: str | None = None, max_connections: int = 32,
                 on_busy: Callable[[], None] | None = None) -> None:
        outer = self
        self._slots = threading.BoundedSemaphore(max_connections)

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: Any, client_address: Any) -> None:
                if not outer._slots.acquire(blocking=False):   # at capacity: refuse rather than spawn a thread
                    if outer.on_busy:
                        outer.on_busy()
                    self.shutdown_request(request)
                    return
                try:
                    super().process_request(request, client_address)
                except BaseException:
                    outer._slots.release()
                    raise

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    outer._slots.release()

        self.token, self.handler, self.timeout = token, handler, timeout
        self.on_auth_failure, self.on_busy = on_auth_failure, on_busy
        self._server = _Server((host, port), _Handler)
        self.host, self.port = self._server.server_address[:2]
        self.engine_id = engine_id
        self.identity = identity(engine_id, advertise_host or self.host, self.port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdserve-kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout
        try:
            sock.settimeout(self.timeout)
            nonce_s = os.urandom(32)
            _send(sock, {"v": VERSION, "nonce": nonce_s, "engine_id": self.engine_id})
            msg = _recv(sock, deadline, MAX_REQUEST_FRAME)
            req, nonce_c, client = (msg.get("req"), msg.get("nonce"), msg.get("from")) if isinstance(msg, dict) else \
                (None, None, None)
            mac = msg.get("mac") if isinstance(msg, dict) else None
            if not (isinstance(req, bytes) and _nonce_ok(nonce_c) and isinstance(client, str) and len(client) <= 256
                    and isinstance(mac, bytes)
                    and hmac.compare_digest(_mac(self.token, "c2s", nonce_s, nonce_c, self.identity, client, req), mac)):
                if self.on_auth_failure:
                    self.on_auth_failure()
                logger.warning("KV side channel: rejected an unauthenticated request from %s (not signed with this "
                               "deployment's secret for %s)", sock.getpeername(), self.identity)
                _send(sock, {"ok": False, "error": "unauthorized"})
                return
            op, body = msgpack.unpackb(req, raw=False)
            try:
                if not isinstance(op, str) or not isinstance(body, dict):
                    raise ValueError("malformed request")
                answer = {"ok": True, "result": self.handler(op, body)}
            except Exception as e:  # a handler error is the caller's answer, not a server crash
                logger.exception("KV side channel: %s failed", op)
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            res = msgpack.packb(answer, use_bin_type=True)
            _send(sock, {"res": res, "mac": _mac(self.token, "s2c", nonce_s, nonce_c, self.identity, client, [req, res])})
        except (OSError, ValueError, TypeError, msgpack.UnpackException) as e:
            logger.debug("KV side channel: connection dropped: %r", e)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Opened:
    """A connection whose server hello (nonce) is in, not yet used: :func:`opened` then ``request`` splits one
    :func:`call` so that the connect and hello can happen before the request exists (e.g. while a READ runs; the
    request stays bound to this connection's fresh nonces). One request per connection; ``close`` if unused."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float, client_id: str,
                 server_engine_id: str | None) -> None:
        self.host, self.port, self.token, self.timeout, self.client_id = host, port, token, timeout, client_id
        self.opened_at = time.monotonic()
        self.deadline = deadline = self.opened_at + timeout
        self.sock: socket.socket | None = None
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
            hello = _recv(self.sock, deadline)
            self.nonce_s, engine = hello["nonce"], hello.get("engine_id")
            if not _nonce_ok(self.nonce_s) or hello.get("v") != VERSION or not isinstance(engine, str):
                raise SideChannelError(f"side channel {host}:{port}: not a pdserve v{VERSION} side channel")
            if server_engine_id is not None and engine != server_engine_id:
                raise PeerUnreachable(f"engine {server_engine_id} is gone ({host}:{port} is now {engine})")
        except BaseException as e:
            self.close()
            if isinstance(e, socket.timeout):
                raise LoadTimeout(f"side channel {host}:{port}: no hello within {timeout}s") from e
            if isinstance(e, (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException)):
                raise PeerUnreachable(f"side channel {host}:{port}: {e!r}") from e
            raise
        self.server = identity(engine, host, port)

    def fresh(self) -> bool:
        """Still well inside the server's per-connection deadline (it closes idle connections after ``timeout``)."""
        return self.sock is not None and time.monotonic() - self.opened_at < self.timeout / 2

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, op: str, body: dict | None = None, deadline: float | None = None) -> dict:
        """Send ``[op, body]`` and return the authenticated answer, by ``deadline`` (default: ``timeout`` from now)."""
        if self.sock is None:
            raise PeerUnreachable(f"side channel {self.host}:{self.port} {op}: connection already used")
        host, port, token, client_id, server = self.host, self.port, self.token, self.client_id, self.server
        req = msgpack.packb([op, body or {}], use_bin_type=True)
        try:
            nonce_c = os.urandom(32)
            _send(self.sock, {"req": req, "nonce": nonce_c, "from": client_id,
                              "mac": _mac(token, "c2s", self.nonce_s, nonce_c, server, client_id, req)})
            reply = _recv(self.sock, deadline or time.monotonic() + self.timeout)
        except socket.timeout as e:
            raise LoadTimeout(f"side channel {host}:{port} {op}: no answer within {self.timeout}s") from e
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise PeerUnreachable(f"side channel {host}:{port} {op}: {e!r}") from e
        finally:
            self.close()
        res, mac = (reply.get("res"), reply.get("mac")) if isinstance(reply, dict) else (None, None)
        if not (isinstance(res, bytes) and isinstance(mac, bytes)):
            error = reply.get("error") if isinstance(reply, dict) else None
            raise SideChannelError(f"side channel {host}:{port} {op}: {error or 'malformed answer'}")
        if not hmac.compare_digest(_mac(token, "s2c", self.nonce_s, nonce_c, server, client_id, [req, res]), mac):
            raise SideChannelError(f"side channel {host}:{port} {op}: the answer is not authenticated (relay or "
                                   f"forgery)")
        answer = msgpack.unpackb(res, raw=False)
        if not answer.get("ok"):
            raise SideChannelError(f"side channel {host}:{port} {op}: {answer.get('error')}")
        return answer["result"]


def opened(host: str, port: int, token: bytes, timeout: float = 5.0, *, client_id: str = "pdserve",
           server_engine_id: str | None = None) -> Opened:
    """Connect and take the server's hello now; send one request later with ``.request(op, body)``."""
    return Opened(host, port, token, timeout, client_id, server_engine_id)


def call(host: str, port: int, token: bytes, op: str, body: dict | None = None, timeout: float = 5.0, *,
         client_id: str = "pdserve", server_engine_id: str | None = None) -> dict:
    """One authenticated request to the engine ``server_engine_id`` (None: whichever answers) at ``host:port``.
    Raises LoadTimeout, PeerUnreachable (including another engine answering there), or SideChannelError (an error
    answer, a rejected request, or an answer that does not authenticate)."""
    conn = opened(host, port, token, timeout, client_id=client_id, server_engine_id=server_engine_id)
    return conn.request(op, body, conn.deadline)   # one deadline for the whole call
