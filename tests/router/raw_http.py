"""A strict HTTP/1.1 response reader over a raw socket, for tests that must see the exact bytes a server sends.

``read_response`` reads exactly one response (framed by Content-Length or chunked encoding, nothing more), so reading
two responses in a row from one keep-alive connection proves the first was framed correctly: a length that disagrees
with the body shows up as garbage where the next status line should be.
"""

from __future__ import annotations

import socket


class ClosedCleanly(EOFError):
    """The server closed the connection between responses (not in the middle of one)."""


class RawResponse:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def header(self, name: str) -> str | None:
        vals = [v for k, v in self.headers if k == name.lower()]
        assert len(vals) <= 1, f"header {name} sent {len(vals)} times: {vals}"
        return vals[0] if vals else None

    def __repr__(self) -> str:
        return f"RawResponse({self.status}, {self.headers}, {self.body[:200]!r})"


class Conn:
    """One client connection with a read buffer."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise EOFError(f"connection closed mid-line: {self.buf[:200]!r}")
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError(f"connection closed with {n - len(self.buf)} body bytes missing")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_response(self, head_only: bool = False) -> RawResponse:
        if not self.buf and not self._fill():
            raise ClosedCleanly("connection closed")
        status_line = self._line()
        parts = status_line.split(b" ", 2)
        assert parts[0] == b"HTTP/1.1" and parts[1].isdigit(), f"not a status line: {status_line[:200]!r}"
        headers = []
        while line := self._line():
            name, sep, value = line.partition(b":")
            assert sep and name == name.strip() and name, f"bad header line {line!r}"
            headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
        resp = RawResponse(int(parts[1]), headers, b"")
        te, cl = resp.header("transfer-encoding"), resp.header("content-length")
        assert not (te and cl), "both Transfer-Encoding and Content-Length"
        if head_only:
            return resp
        if te is not None:
            assert te == "chunked", te
            body = b""
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    assert self._line() == b""
                    break
                body += self._exact(size)
                assert self._exact(2) == b"\r\n"
            resp.body = body
        elif cl is not None:
            resp.body = self._exact(int(cl))
        else:  # read to EOF
            while self._fill():
                pass
            resp.body, self.buf = self.buf, b""
        return resp

    def at_eof(self, timeout: float = 5.0) -> bool:
        """True if the server closed the connection (with nothing left unread) within ``timeout``."""
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return not self.buf
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(old)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_openai_error(resp: RawResponse) -> bool:
    import json

    try:
        err = json.loads(resp.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
