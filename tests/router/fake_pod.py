"""A fast fake OpenAI pod: a real HTTP server (uvicorn) on loopback speaking the OpenAI + kv_transfer_params protocol.

Used where a real pdserve pod would be too slow or cannot be made to misbehave on cue (router reliability tests and
the router benchmark's "fast fake backend"). It answers completions/chat (JSON or SSE), acts as a prefill pod when
asked for ``do_remote_decode`` (returns ``kv_transfer_params``), records every request, and can be told to fail
(``status``), to omit kv params, to stream slowly, or to report load in ``/metrics``. It notices client disconnects
(``disconnects``), which is how tests see that the router cancelled an upstream request.

Run standalone for benchmarks: ``python tests/router/fake_pod.py --port 9000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

try:
    from tests.router.asgi_echo import read_body, serve_lifespan
except ImportError:  # run as a script (benchmarks/router.py): this folder is sys.path[0]
    from asgi_echo import read_body, serve_lifespan

HEALTHY = b'{"status":"ok"}'


@dataclass
class FakeState:
    name: str = "pod"
    status: int = 200                # answer generation requests with this status (non-200: an error body)
    retry_after: str | None = None   # ... with this Retry-After header (a pdserve pod's full queue: 503 + Retry-After)
    api_key: str | None = None       # require 'Authorization: Bearer KEY' on /v1/* and /metrics (a pod's --api-key)
    health_delay: float = 0.0        # seconds before answering /health (a busy pod)
    healthy: bool = True
    kv_params: bool = True           # as prefill, return kv_transfer_params
    kv_params_value: dict | None = None  # ... exactly these (else made-up NIXL-style ones)
    stream_chunks: int = 3
    chunk_delay: float = 0.0         # seconds between SSE chunks
    delay: float = 0.0               # seconds before answering (headers)
    waiting: float = 0.0             # reported vllm:num_requests_waiting
    running: float = 0.0
    kv_usage: float = 0.0
    record: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"path", "body", "headers"}
    disconnects: int = 0
    unauthorized: int = 0            # requests refused for a missing/wrong key
    health_checks: list[dict[str, str]] = field(default_factory=list)  # headers of each /health request
    sent_chunks: int = 0             # SSE chunks written so far (all streams)
    count: int = 0


def completion_json(name: str, path: str, text: str, kv_params: dict | None = None) -> dict:
    if path.endswith("/chat/completions"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        obj = "text_completion"
    out = {"id": f"cmpl-{name}", "object": obj, "created": 0, "model": "fake", "choices": [choice],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    if kv_params is not None:
        out["kv_transfer_params"] = kv_params
    return out


class FakePod:
    def __init__(self, state: FakeState | None = None):
        self.state = state or FakeState()
        self._fast = {}  # path -> precomputed JSON body (the benchmark's hot path)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        st, path = self.state, scope["path"]
        if path == "/health":
            if st.record:
                st.health_checks.append({k.decode(): v.decode() for k, v in scope["headers"]})
            if st.health_delay:
                await asyncio.sleep(st.health_delay)
            await _send(send, 200 if st.healthy else 503, HEALTHY)
            return
        if st.api_key is not None and (b"authorization", f"Bearer {st.api_key}".encode()) not in scope["headers"]:
            st.unauthorized += 1
            err = {"error": {"message": "invalid or missing API key", "type": "authentication_error", "param": None,
                             "code": "invalid_api_key"}}
            await _send(send, 401, json.dumps(err).encode())
            return
        if path == "/metrics":
            text = (f"vllm:num_requests_waiting{{model_name=\"fake\"}} {st.waiting}\n"
                    f"vllm:num_requests_running{{model_name=\"fake\"}} {st.running}\n"
                    f"vllm:kv_cache_usage_perc{{model_name=\"fake\"}} {st.kv_usage}\n")
            await _send(send, 200, text.encode(), b"text/plain")
            return
        if path == "/v1/models":
            await _send(send, 200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())
            return
        body = await read_body(receive)
        if body is None:
            return
        st.count += 1
        if not st.record and st.status == 200 and not st.delay:
            fast = self._fast.get(path)
            if fast is None:
                fast = self._fast[path] = json.dumps(completion_json(st.name, path, "ok")).encode()
            if b'"stream": true' not in body and b'"stream":true' not in body:
                await _send(send, 200, fast)
                return
        req = json.loads(body)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if st.record:
            st.requests.append({"path": path, "body": req, "headers": headers})
        if st.delay:
            await asyncio.sleep(st.delay)
        if st.status != 200:
            err = {"error": {"message": f"{st.name} failing", "type": "server_error", "param": None, "code": None}}
            extra = [(b"retry-after", st.retry_after.encode())] if st.retry_after else []
            await _send(send, st.status, json.dumps(err).encode(), extra=extra)
            return
        kvp = req.get("kv_transfer_params")
        if kvp is not None and not isinstance(kvp, dict):  # (a real pod validates this with pydantic)
            await _send(send, 400, json.dumps({"error": {"message": "kv_transfer_params must be an object",
                                                         "type": "invalid_request_error", "param": None,
                                                         "code": None}}).encode())
            return
        kvp = req.get("kv_transfer_params") or {}
        if kvp.get("do_remote_decode"):
            params = ({"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                       "remote_engine_id": f"engine-{st.name}", "remote_request_id": headers.get("x-request-id"),
                       "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1} if st.kv_params else None)
            if st.kv_params and st.kv_params_value is not None:
                params = st.kv_params_value
            await _send(send, 200, json.dumps(completion_json(st.name, path, "p", params)).encode())
            return
        if not req.get("stream"):
            await _send(send, 200, json.dumps(completion_json(st.name, path, f"from {st.name}")).encode())
            return
        await self._stream(path, receive, send)

    async def _stream(self, path, receive, send):
        st = self.state
        gone = asyncio.Event()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        try:
            for i in range(st.stream_chunks):
                if i and st.chunk_delay:
                    try:
                        await asyncio.wait_for(gone.wait(), st.chunk_delay)
                    except asyncio.TimeoutError:
                        pass
                if gone.is_set():
                    st.disconnects += 1
                    return
                if path.endswith("/chat/completions"):
                    delta = {"choices": [{"index": 0, "delta": {"content": f"{st.name}-{i} "}}]}
                else:
                    delta = {"choices": [{"index": 0, "text": f"{st.name}-{i} "}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(delta)}\n\n".encode(),
                            "more_body": True})
                st.sent_chunks += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            watcher.cancel()


async def _send(send, status: int, body: bytes, ctype: bytes = b"application/json", extra=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


class ServerThread:
    """Run an ASGI app on 127.0.0.1 in a background thread: under uvicorn (uvloop + httptools), or with
    ``router=True`` under the router's own HTTP server (``pdserve.router.http_server``)."""

    def __init__(self, app, port: int = 0, host: str = "127.0.0.1", router: bool = False):
        from pdserve.router.cli import uvicorn_config

        import socket

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.app, self.host, self.port = app, host, port
        if router:
            self.server = _RouterServer(app, host, port)
        else:
            self.server = uvicorn.Server(uvicorn_config(app, host, port, "error"))
            self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class _RouterServer:
    """uvicorn.Server's thread-facing surface (run / started / should_exit) over the router's HTTP server."""

    def __init__(self, app, host: str, port: int):
        self.app, self.host, self.port = app, host, port
        self.started = False
        self._loop = self._server = None

    @property
    def should_exit(self) -> bool:
        return False

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value and self._loop is not None:
            self._loop.call_soon_threadsafe(self._server.stop)

    def run(self) -> None:
        import uvloop

        from pdserve.router.http_server import Server

        async def main():
            self._loop = asyncio.get_running_loop()
            self._server = Server(self.app, self.host, self.port, drain_timeout=5)
            task = asyncio.create_task(self._server.serve(install_signals=False))
            await self._server.started.wait()
            self.started = True
            await task

        uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    a = ap.parse_args()
    from pdserve.router.cli import uvicorn_config

    app = FakePod(FakeState(name=a.name, record=False))
    uvicorn.Server(uvicorn_config(app, a.host, a.port, "error")).run()


if __name__ == "__main__":
    main()
