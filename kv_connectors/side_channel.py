"""An authenticated request/response side channel: length-prefixed msgpack frames over TCP. No pickle.

One short connection per call. The server opens with a random nonce; the client answers with
``{"op", "body", "mac"}`` where ``mac = HMAC-SHA256(token, nonce || msgpack(op, body))``, so the shared token never
crosses the wire and a captured request cannot be replayed. The server checks the MAC with ``hmac.compare_digest``
before running the handler. Every socket operation has a timeout; frames are capped at ``MAX_FRAME`` bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from pdserve.kv_connectors.load_errors import LoadTimeout, PeerUnreachable, logger

MAX_FRAME = 16 << 20
_LEN = struct.Struct(">I")


class SideChannelError(PeerUnreachable):
    """The peer answered with an error (including a failed authentication)."""


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return msgpack.unpackb(_recv_exact(sock, n), raw=False)


def _mac(token: bytes, nonce: bytes, op: str, body: Any) -> bytes:
    return hmac.new(token, nonce + msgpack.packb([op, body], use_bin_type=True), hashlib.sha256).digest()


class SideChannelServer:
    """Serves ``handler(op, body) -> dict`` on ``host:port`` (port 0: the OS picks; see ``.port``)."""

    def __init__(self, host: str, port: int, token: bytes, handler: Callable[[str, dict], dict],
                 timeout: float = 5.0, on_auth_failure: Callable[[], None] | None = None) -> None:
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.token, self.handler, self.timeout, self.on_auth_failure = token, handler, timeout, on_auth_failure
        self._server = _Server((host, port), _Handler)
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdserve-kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(self.timeout)
        try:
            nonce = os.urandom(32)
            _send(sock, {"nonce": nonce, "v": 1})
            msg = _recv(sock)
            op, body, mac = msg.get("op"), msg.get("body") or {}, msg.get("mac") or b""
            if not isinstance(op, str) or not hmac.compare_digest(_mac(self.token, nonce, op, body), mac):
                if self.on_auth_failure:
                    self.on_auth_failure()
                logger.warning("KV side channel: rejected an unauthenticated %r request from %s", op,
                               sock.getpeername())
                _send(sock, {"ok": False, "error": "unauthorized"})
                return
            try:
                _send(sock, {"ok": True, "result": self.handler(op, body)})
            except Exception as e:  # a handler error is the caller's answer, not a server crash
                logger.exception("KV side channel: %s failed", op)
                _send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        except (OSError, ValueError, msgpack.UnpackException) as e:
            logger.debug("KV side channel: connection dropped: %r", e)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def call(host: str, port: int, token: bytes, op: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    """One authenticated request. Raises LoadTimeout, PeerUnreachable, or SideChannelError (an error answer)."""
    body = body or {}
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            hello = _recv(sock)
            _send(sock, {"op": op, "body": body, "mac": _mac(token, hello["nonce"], op, body)})
            reply = _recv(sock)
    except socket.timeout as e:
        raise LoadTimeout(f"side channel {host}:{port} {op}: no answer within {timeout}s") from e
    except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise PeerUnreachable(f"side channel {host}:{port} {op}: {e!r}") from e
    if not reply.get("ok"):
        raise SideChannelError(f"side channel {host}:{port} {op}: {reply.get('error')}")
    return reply["result"]
