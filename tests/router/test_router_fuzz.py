"""Acceptance fuzz of ``pdserve router``: hypothesis over OpenAI request bodies (``router_requests`` of
tests/support/openai_strategies.py, the strategies the server's fuzz test draws from),
sent over one raw keep-alive connection (so any mis-framed answer breaks the next exchange): never a 5xx, every error
OpenAI-shaped, every answer framed exactly.

Two back ends, bounded in count and time: the fake pods (fast; many examples, P/D handoff and precise prefix
routing included), and a short run against a real ``pdserve serve`` pod (CPU, the default model) that requires an
API key the router presents upstream.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from pdserve.router.config import RouterConfig
from tests.router.raw_http import Conn, is_openai_error
from tests.support.openai_strategies import router_requests
from tests.support.server import launch_server

MODEL = "SmolLM2-135M-Instruct"
router_request = router_requests(MODEL)


def exchange(conn: Conn, path: str, body: bytes, headers: dict[str, str]) -> None:
    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in headers.items())
    conn.send(b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
              % (path.encode(), len(body), extra, body))
    resp = conn.read_response()
    assert resp.status < 500, (resp, body[:300])
    if resp.status >= 400:
        assert is_openai_error(resp), (resp, body[:300])
    elif resp.header("content-type") == "application/json":
        json.loads(resp.body)


class Client:
    """One keep-alive connection to the router, reopened only when the router closed it (after a 4xx it may)."""

    def __init__(self, port: int):
        self.port, self.conn = port, None

    def check(self, path: str, body: bytes, headers: dict[str, str]) -> None:
        if self.conn is None:
            self.conn = Conn(self.port, timeout=300)
        try:
            exchange(self.conn, path, body, headers)
        except BaseException:
            self.close()
            raise
        if self.conn.at_eof(timeout=0.001):
            self.close()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@pytest.fixture
def fake_client(pods, make_router, tokenizer):
    (p, sp), (d, sd), (w, sw) = pods
    for pod, _ in pods:
        pod.state.record = False
    _, r = make_router(RouterConfig(prefill=(sp.url,), decode=(sd.url, sw.url), pd_threshold=4,
                                    policy="precise-prefix", max_body_bytes=1 << 20), tokenizer=tokenizer)
    client = Client(r.port)
    yield client
    client.close()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=router_request)
def test_fuzz_router_on_fake_pods(fake_client, req):
    fake_client.check(*req)


@pytest.fixture(scope="module")
def real_pod():
    with launch_server("--max-model-len", "512", "--num-gpu-blocks", "128", "--max-num-seqs", "8",
                       env={"PDSERVE_API_KEY": "pod-key"}) as h:
        yield h


@pytest.fixture
def real_client(real_pod, make_router, tokenizer):
    _, r = make_router(RouterConfig(workers=(real_pod.url,), policy="precise-prefix", upstream_api_key="pod-key",
                                    max_retries=0), tokenizer=tokenizer)
    client = Client(r.port)
    yield client, real_pod.url
    client.close()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=router_request)
def test_fuzz_router_on_a_real_pod(real_client, req):
    client, pod_url = real_client
    client.check(*req)
    assert httpx.get(pod_url + "/health", timeout=30).status_code == 200, "the pod's engine died"
