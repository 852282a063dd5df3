"""Conformance of the router's upstream HTTP client (``router/http_client.py``) against a scripted raw-socket pod:
response framings (content-length, chunked with extensions and trailers, close-delimited), 1xx interim answers,
ambiguous framing refused, pods closing mid-body or sending bytes nobody asked for, header limits, keep-alive reuse
only after a fully read response, and the stale pooled connection retried once."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.http_client import Pool, ProtocolError


class ScriptedPod:
    """Answers the n-th request on any connection with ``script[n]`` (bytes), then closes if the item says so."""

    def __init__(self, script: list[tuple[bytes, bool]]):
        self.script, self.n, self.connections, self.requests = script, 0, 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                data, close = self.script[min(self.n, len(self.script) - 1)]
                self.n += 1
                writer.write(data)
                await writer.drain()
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def get(pool: Pool, url: str) -> tuple[int, dict, bytes]:
    resp = await pool.request("POST", url + "/v1/completions", b"{}", {"content-type": "application/json"})
    try:
        return resp.status, resp.headers, await resp.read()
    finally:
        resp.release()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@pytest.mark.parametrize("raw, body", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b"hello"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n00A\r\n0123456789\r\n0\r\nT: 1\r\n\r\n",
     b"abc0123456789"),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n" + OK, b"ok"),
])
async def test_framings_and_keep_alive_reuse(raw, body):
    pod = ScriptedPod([(raw, False)])
    async with pod as url:
        pool = Pool(timeout=5)
        for _ in range(3):
            status, headers, got = await get(pool, url)
            assert (status, got) == (200, body) and "link" not in headers
        assert pod.connections == 1  # fully read keep-alive responses: one connection
        pool.close()


async def test_close_delimited_body():
    pod = ScriptedPod([(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end", True)])
    async with pod as url:
        pool = Pool(timeout=5)
        assert await get(pool, url) == (200, {"content-type": "text/plain"}, b"until the end")
        assert (await get(pool, url))[2] == b"until the end" and pod.connections == 2
        pool.close()


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok!",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000 + b"\r\ncontent-length: 2\r\n\r\nok",
    b"NOT HTTP\r\n\r\n",
])
async def test_ambiguous_or_broken_responses_fail_the_attempt(raw):
    pod = ScriptedPod([(raw, False), (OK, False)])
    async with pod as url:
        pool = Pool(timeout=5)
        with pytest.raises(ProtocolError):
            await get(pool, url)
        assert await get(pool, url) == (200, {"content-length": "2"}, b"ok")  # on a fresh connection
        assert pod.connections == 2
        pool.close()


async def test_pod_closing_mid_body_and_unsolicited_bytes():
    pod = ScriptedPod([(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", True),
                       (OK + b"HTTP/1.1 200 OK\r\n", False), (OK, False)])
    async with pod as url:
        pool = Pool(timeout=5)
        with pytest.raises(ProtocolError):
            await get(pool, url)
        assert (await get(pool, url))[2] == b"ok"  # followed by bytes nobody asked for: that connection is dropped
        await asyncio.sleep(0.05)
        assert (await get(pool, url))[2] == b"ok" and pod.connections == 3
        pool.close()


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    pod = ScriptedPod([(OK, True), (OK, False)])  # the first answer closes its connection after it (pod restarted)
    async with pod as url:
        pool = Pool(timeout=5)
        assert (await get(pool, url))[2] == b"ok"
        await asyncio.sleep(0.05)
        assert (await get(pool, url))[2] == b"ok" and pod.connections == 2
        pool.close()
