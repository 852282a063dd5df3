"""HTTP/1.1 conformance and fuzzing of the router's own server (``router/http_server.py``) over raw sockets.

What hand-written HTTP gets wrong is framing, and a framing disagreement between a proxy and its client is request
smuggling or a desynchronized keep-alive connection. So every test here reads responses strictly
(``raw_http.Conn.read_response`` reads exactly what the framing says) and then proves the connection is still in sync
by sending another request on it, or that the server closed it. Covered: conflicting Content-Length /
Transfer-Encoding, chunked edge cases, pipelining (also split at arbitrary byte boundaries), header and body limits,
slow clients, half-closed sockets, ``Expect: 100-continue``, HEAD, and responses whose declared length the app gets
wrong or whose headers would split the response. Hypothesis fuzzes header sets, bodies, framings and byte splits.
"""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.asgi_echo import echo_app, echo_line
from tests.router.fake_pod import ServerThread
from tests.router.raw_http import ClosedCleanly, Conn, is_openai_error

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server():
    with ServerThread(echo_app, router=True) as s:
        yield s


def req(method: str, path: str, body: bytes | None = None, headers: bytes = b"", chunked: bool = False) -> bytes:
    head = b"%s %s HTTP/1.1\r\nHost: x\r\n%s" % (method.encode(), path.encode(), headers)
    if body is None:
        return head + b"\r\n"
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") \
            + b"0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def still_in_sync(c: Conn) -> None:
    c.send(req("GET", "/after"))
    resp = c.read_response()
    assert resp.status == 200 and resp.body == echo_line("GET", "/after", b""), resp


def rejected(c: Conn, status: int = 400) -> None:
    resp = c.read_response()
    assert resp.status == status and is_openai_error(resp), resp
    assert resp.header("connection") == "close" and c.at_eof()


# -- request framing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    # both framings: which one a front proxy used is unknowable -> refuse (RFC 9112 6.3)
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n",
    # two different lengths
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 4, 5\r\n\r\nabcde",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: +4\r\n\r\nabcd",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n",
    # codings other than a final "chunked"
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabcd",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    # bad chunks
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\nabc\r\n0\r\n\r\n",
    # header syntax that front proxies read differently
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length : 4\r\n\r\nabcd",
    b"POST /a HTTP/1.1\r\nHost: x\r\n Content-Length: 4\r\n\r\nabcd",
    b"POST /a HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n",
    b"POST /a HTTP/1.1\nHost: x\nContent-Length: 4\n\nabcd",
    b"GET /a HTTP/1.1\r\nHost: x\r\nX\x00: y\r\n\r\n",
    b"GET /a\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /a HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
])
def test_ambiguous_or_malformed_requests_are_refused_and_the_connection_closed(server, raw):
    with Conn(server.port) as c:
        c.send(raw)
        rejected(c)


def test_other_http_versions_are_refused(server):
    for raw, status in ((b"GET /a HTTP/2.0\r\nHost: x\r\n\r\n", 505), (b"GET /a HTTP/1.2\r\nHost: x\r\n\r\n", 400)):
        with Conn(server.port) as c:
            c.send(raw)
            rejected(c, status)


def test_chunked_edge_cases_that_are_valid(server):
    with Conn(server.port) as c:
        # extensions, upper-case hex, leading zeros, a trailer, an empty body
        c.send(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3;ext=1;q=\"v\"\r\nabc\r\n00A\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n")
        assert c.read_response().body == echo_line("POST", "/x", b"abc0123456789")
        c.send(req("POST", "/y", b"", chunked=True))
        assert c.read_response().body == echo_line("POST", "/y", b"")
        c.send(b"POST /z HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n1\r\nq\r\n0\r\n\r\n")
        assert c.read_response().body == echo_line("POST", "/z", b"q")
        still_in_sync(c)


def test_pipelined_requests_are_answered_in_order(server):
    batch = (req("POST", "/1", b"one") + req("GET", "/2") + req("POST", "/3", b"three", chunked=True)
             + req("POST", "/stream", b"x" * 30) + req("POST", "/5", b"five"))
    with Conn(server.port) as c:
        c.send(batch)
        for method, path, body in (("POST", "/1", b"one"), ("GET", "/2", b""), ("POST", "/3", b"three"),
                                   ("POST", "/stream", b"x" * 30), ("POST", "/5", b"five")):
            assert c.read_response().body == echo_line(method, path, body)
        still_in_sync(c)


def test_header_and_body_limits(server):
    with Conn(server.port) as c:
        c.send(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 70_000 + b"\r\n\r\n")
        rejected(c, 431)
    with Conn(server.port) as c:  # many small headers add up too
        c.send(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 60) for i in range(2000))
               + b"\r\n")
        rejected(c, 431)
    with Conn(server.port) as c:  # a large body streams through (back-pressure, no limit at this layer)
        body = bytes(range(256)) * 8192
        c.send(req("POST", "/big", body))
        assert c.read_response().body == echo_line("POST", "/big", body)
        still_in_sync(c)


def test_http10_and_connection_close(server):
    with Conn(server.port) as c:
        c.send(b"GET /old HTTP/1.0\r\n\r\n")
        resp = c.read_response()
        assert resp.body == echo_line("GET", "/old", b"") and c.at_eof()
    with Conn(server.port) as c:
        c.send(b"GET /ka HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert c.read_response().body == echo_line("GET", "/ka", b"")
        still_in_sync(c)


def test_head_has_no_body_and_100_continue(server):
    with Conn(server.port) as c:
        c.send(req("HEAD", "/h"))
        resp = c.read_response(head_only=True)
        assert resp.status == 200 and int(resp.header("content-length")) == len(echo_line("HEAD", "/h", b""))
        still_in_sync(c)  # a body after the HEAD answer would show up here
    with Conn(server.port) as c:
        c.send(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert c._line() == b"HTTP/1.1 100 Continue" and c._line() == b""
        c.send(b"abcd")
        assert c.read_response().body == echo_line("POST", "/e", b"abcd")


# -- response framing is the server's, whatever the app does ----------------------------------------------------------

def test_an_app_declaring_the_wrong_length_cannot_desync_the_connection(server):
    with Conn(server.port) as c:
        c.send(req("GET", "/wrong-length-long"))
        assert c.read_response().body == b"hello"
        still_in_sync(c)  # the 6 excess bytes were never sent
    with Conn(server.port) as c:
        c.send(req("GET", "/wrong-length-short"))
        with pytest.raises(EOFError):  # a short body ends the connection: a truncated message, never a desync
            c.read_response()


def test_response_headers_cannot_be_split_and_app_errors_are_framed(server):
    for path in ("/split-header", "/raise"):
        with Conn(server.port) as c:
            c.send(req("GET", path))
            resp = c.read_response()
            assert resp.status == 500 and is_openai_error(resp) and resp.header("x-id") is None
            still_in_sync(c)


# -- slow, half-closed and vanishing clients -------------------------------------------------------------------------

def test_slow_client_byte_by_byte(server):
    data = req("POST", "/slow", b"0123456789", headers=b"X-A: b\r\n")
    with Conn(server.port) as c:
        for i in range(len(data)):
            c.send(data[i:i + 1])
            time.sleep(0.002)
        assert c.read_response().body == echo_line("POST", "/slow", b"0123456789")


def test_half_closed_client_still_gets_its_answers(server):
    with Conn(server.port) as c:
        c.send(req("POST", "/later", b"one") + req("POST", "/stream", b"two"))
        c.sock.shutdown(socket.SHUT_WR)
        assert c.read_response().body == echo_line("POST", "/later", b"one")
        assert c.read_response().body == echo_line("POST", "/stream", b"two")
        assert c.at_eof()
    with Conn(server.port) as c:  # cut off mid-body by the FIN: closed, nothing answered
        c.send(b"POST /cut HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        c.sock.shutdown(socket.SHUT_WR)
        assert c.at_eof()


def test_clients_vanishing_mid_request_do_not_hurt_the_server(server):
    for raw in (req("POST", "/v", b"x" * 100_000)[:50_000], req("POST", "/stream", b"y" * 10_000)):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(raw)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.close()
    with Conn(server.port) as c:
        still_in_sync(c)


# -- fuzz ------------------------------------------------------------------------------------------------------------

_token = st.text("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1,
                 max_size=20).filter(lambda n: n.lower() not in ("content-length", "transfer-encoding", "connection",
                                                                  "expect", "upgrade", "host"))
_value = st.binary(max_size=60).map(lambda b: bytes(c for c in b if c == 9 or 0x20 <= c <= 0x7e or c >= 0x80).strip())
_request = st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS"]),
                     st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~/", max_size=30).map(lambda p: "/" + p),
                     st.lists(st.tuples(_token, _value), max_size=8), st.binary(max_size=3000), st.booleans())


@FUZZ
@given(reqs=st.lists(_request, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 20_000), max_size=6))
def test_fuzz_valid_requests_pipelined_and_split_anywhere(server, reqs, cuts):
    data = b"".join(req(m, p, b, b"".join(b"%s: %s\r\n" % (n.encode(), v) for n, v in hs), chunked=ch)
                    for m, p, hs, b, ch in reqs)
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    with Conn(server.port) as c:
        for a, b in zip(points, points[1:]):
            c.send(data[a:b])
        for m, p, _, b, _ in reqs:
            assert c.read_response().body == echo_line(m, p, b)
        still_in_sync(c)


@FUZZ
@given(prefix=st.sampled_from([b"", b"GET / HTTP/1.1\r\n", b"POST /a HTTP/1.1\r\nHost: x\r\n",
                               b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"]),
       junk=st.binary(min_size=1, max_size=400))
def test_fuzz_garbage_gets_a_clean_answer_or_a_close(server, prefix, junk):
    """Whatever arrives: complete well-framed responses (4xx for what the server refuses, never 5xx), then either
    the connection stays usable or it closes; the server survives."""
    with Conn(server.port, timeout=5) as c:
        c.send(prefix + junk + b"\r\n\r\n")
        c.sock.shutdown(socket.SHUT_WR)  # no more input: everything must resolve now
        while True:
            try:
                resp = c.read_response()
            except ClosedCleanly:
                break
            assert resp.status < 500 or resp.status == 505, resp  # (505: a request line naming HTTP/2+)
            if resp.status >= 400:
                assert is_openai_error(resp), resp
    with Conn(server.port) as c:
        still_in_sync(c)
