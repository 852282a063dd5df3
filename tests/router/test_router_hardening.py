"""Issue 20's router defects, each reproduced against a real router over loopback in front of fake pods: framing of
error answers on keep-alive connections, request ids that cannot travel in headers, overload that is not failure,
Retry-After relayed, the upstream API key, no second run of a sent request after a timeout, slow health replies,
long prompts tokenized off the event loop, tenant-derived cache salts, the bounded metric memo, and client
disconnects without ``Task.uncancel`` (Python 3.10)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading

import httpx
import pytest

from pdserve.router.app import RouterApp
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from tests.router.raw_http import Conn, is_openai_error
from tests.router.test_router_proxy import urls, wait_for


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def test_deeply_nested_json_is_a_400_and_the_connection_stays_in_sync(pods, make_router):
    _, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin"))
    with Conn(r.port) as c:
        for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
            c.send(post("/v1/completions", body))
            resp = c.read_response()  # exactly content-length bytes: the next read must be the next response
            assert resp.status == 400 and is_openai_error(resp), resp
            assert "nested too deeply" in json.loads(resp.body)["error"]["message"]
        c.send(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        assert json.loads(c.read_response().body)["status"] == "ok"
    assert pods[0][0].state.count == 0


@pytest.mark.parametrize("rid", ["x\r\ny", "caf\u00e9", "\u65e5\u672c", "a b", "x" * 300, 7])
def test_request_id_that_cannot_travel_in_a_header_is_a_400_before_any_work(pods, make_router, rid):
    app, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin"))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi", "request_id": rid})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "request_id"
    assert pods[0][0].state.count == 0 and app.pool.get(pods[0][1].url).breaker.failures == 0


def test_request_id_header_and_body(pods, make_router):
    _, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin"))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi", "request_id": "body-1"},
                      headers={"x-request-id": "hdr-1"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "body-1"  # the pod uses the body's too
    assert pods[0][0].state.requests[-1]["headers"]["x-request-id"] == "body-1"
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi"},
                      headers={"x-request-id": "caf\u00e9".encode("latin-1")})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-request-id"


def test_pod_overload_is_relayed_with_retry_after_and_never_opens_the_breaker(pods, make_router):
    (busy, sb), (ok, so) = pods[0], pods[1]
    busy.state.status, busy.state.retry_after = 503, "7"
    app, r = make_router(RouterConfig(workers=(sb.url,), policy="round-robin", cb_failure_threshold=2,
                                      max_retries=0))
    with httpx.Client(base_url=r.url) as c:
        for _ in range(6):
            resp = c.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status_code == 503 and resp.headers["retry-after"] == "7", resp.headers
            assert resp.json()["error"]["message"] == "p0 failing"  # the pod's own answer, not the router's
    assert busy.state.count == 6 and app.pool.get(sb.url).breaker.state == "closed"
    # a 503 without Retry-After is a failing pod: it still opens the breaker
    busy.state.retry_after = None
    for _ in range(2):
        httpx.post(r.url + "/v1/completions", json={"prompt": "hi"})
    assert app.pool.get(sb.url).breaker.state == "open"
    # with another pod, overload is retried there
    busy.state.retry_after = "7"
    app, r = make_router(RouterConfig(workers=(sb.url, so.url), policy="round-robin", cb_failure_threshold=1))
    with httpx.Client(base_url=r.url) as c:
        assert {c.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"]
                for _ in range(4)} == {"from p1"}
    assert app.pool.get(sb.url).breaker.state == "closed"


def test_upstream_api_key_on_every_request_to_the_pods(pods, make_router):
    (a, sa), (b, sb) = pods[0], pods[1]
    for pod in (a, b):
        pod.state.api_key, pod.state.waiting = "pod-key", 3
    app, r = make_router(RouterConfig(workers=(sa.url, sb.url), policy="round-robin", api_key="client-key",
                                      upstream_api_key="pod-key", health_interval=0.1))
    wait_for(lambda: app.pool.get(sa.url).waiting == 3, what="authenticated /metrics scrape")
    auth = {"Authorization": "Bearer client-key"}
    with httpx.Client(base_url=r.url, headers=auth) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "stream": True}).status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == "fake"
    assert a.state.unauthorized == b.state.unauthorized == 0
    sent = [q["headers"]["authorization"] for p in (a, b) for q in p.state.requests]
    assert sent and set(sent) == {"Bearer pod-key"}  # the pods' key, never the client's
    assert a.state.health_checks[-1]["authorization"] == "Bearer pod-key"


def test_upstream_api_key_flag_and_env(monkeypatch):
    import argparse

    from pdserve.router import cli

    parser = cli.add_parser(argparse.ArgumentParser().add_subparsers())
    monkeypatch.setenv("PDSERVE_UPSTREAM_API_KEY", "from-env")
    assert cli.config_from_args(parser.parse_args(["--worker", "http://h:1"])).upstream_api_key == "from-env"
    args = parser.parse_args(["--worker", "http://h:1", "--upstream-api-key", "flag"])
    assert cli.config_from_args(args).upstream_api_key == "flag"


def test_a_sent_request_that_times_out_is_not_run_again_elsewhere(pods, make_router):
    for pod, _ in pods[:2]:
        pod.state.delay = 1.5
    app, r = make_router(RouterConfig(workers=urls(pods, [0, 1]), policy="round-robin", request_timeout=0.5,
                                      max_retries=2))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"
    assert pods[0][0].state.count + pods[1][0].state.count == 1  # the work ran once


def test_a_prefill_that_times_out_is_not_run_again_on_another_prefill_pod(pods, make_router):
    (p1, s1), (p2, s2), (d, sd) = pods[0], pods[1], pods[2]
    p1.state.delay = p2.state.delay = 1.5
    app, r = make_router(RouterConfig(prefill=(s1.url, s2.url), decode=(sd.url,), pd_threshold=0,
                                      policy="round-robin", request_timeout=0.5, max_retries=2))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "a prompt long enough to prefill " * 4}, timeout=30)
    assert resp.status_code == 200  # decode-only fallback
    assert p1.state.count + p2.state.count == 1  # the prefill ran once
    assert d.state.count == 1


def test_slow_health_replies_do_not_make_a_pod_unhealthy(pods, make_router):
    (a, sa), (b, sb) = pods[0], pods[1]
    app, r = make_router(RouterConfig(workers=(sa.url,), policy="round-robin", health_interval=0.05,
                                      health_timeout=0.2, health_slow_limit=10))
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    a.state.health_delay = 0.5
    start = app.health.rounds
    wait_for(lambda: app.health.rounds >= start + 4, what="four slow rounds")
    ep = app.pool.get(sa.url)
    assert ep.healthy and ep.breaker.state == "closed"
    assert httpx.post(r.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    wait_for(lambda: not ep.healthy, what="unhealthy after health_slow_limit slow checks")  # persistent: it counts
    a.state.health_delay = 0
    wait_for(lambda: ep.healthy, what="healthy again")


class GatedTokenizer:
    """The real tokenizer behind a gate, to hold one long prompt's tokenization for as long as the test needs."""

    def __init__(self, real, min_chars: int):
        self.real, self.min_chars = real, min_chars
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: set[str] = set()

    def token_ids(self, path, body):
        if len(str(body.get("prompt", ""))) >= self.min_chars:
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(60)
        return self.real.token_ids(path, body)


def test_a_long_prompt_is_tokenized_off_the_event_loop(pods, make_router, tokenizer):
    gated = GatedTokenizer(tokenizer, 100_000)
    app, r = make_router(RouterConfig(workers=urls(pods, [0, 1]), policy="precise-prefix"), tokenizer=gated)
    big: dict = {}
    t = threading.Thread(target=lambda: big.setdefault("resp", httpx.post(
        r.url + "/v1/completions", json={"prompt": "lorem ipsum " * 20_000, "max_tokens": 1}, timeout=60)))
    t.start()
    try:
        assert gated.entered.wait(30)
        # while the long prompt is being tokenized, the router still answers everyone else
        with httpx.Client(base_url=r.url, timeout=10) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json={"prompt": "short"}).status_code == 200
    finally:
        gated.release.set()
        t.join(60)
    assert big["resp"].status_code == 200
    assert gated.threads and all(n.startswith("router-tokenize") for n in gated.threads)


def test_cache_salt_derived_from_the_tenant_overrides_the_clients(pods, make_router):
    pod = pods[0][0]
    app, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin", cache_salt_from="header",
                                      cache_salt_secret="s3cret"))

    def salt_for(tenant: str | None, client_salt: str | None = None) -> str:
        body = {"prompt": "hi", **({"cache_salt": client_salt} if client_salt else {})}
        headers = {"x-tenant-id": tenant} if tenant else {}
        resp = httpx.post(r.url + "/v1/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return pod.state.requests[-1]["body"]["cache_salt"]

    expect = "t-" + hmac.new(b"s3cret", b"alice", hashlib.sha256).hexdigest()[:40]
    assert salt_for("alice") == expect == salt_for("alice")
    bob = salt_for("bob")
    assert bob != expect
    assert salt_for("bob", client_salt=expect) not in (expect, bob)  # copying alice's salt gets bob nowhere near it
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_tenant"
    # from the API key: each key is a tenant
    app, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin", cache_salt_from="api-key",
                                      cache_salt_secret="s3cret"))
    httpx.post(r.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer k1"})
    assert pod.state.requests[-1]["body"]["cache_salt"] == "t-" + hmac.new(b"s3cret", b"k1",
                                                                          hashlib.sha256).hexdigest()[:40]


def test_metric_memo_is_bounded_and_removed_pods_leave_no_series():
    from pdserve.router.metrics import MAX_MEMO

    m = RouterMetrics()
    for i in range(MAX_MEMO + 500):
        m.child(m.decisions, "decode", f"http://10.0.0.{i}:8000").inc()
    assert len(m._children) <= MAX_MEMO
    m.forget_endpoint("http://10.0.0.1:8000")
    assert b'endpoint="http://10.0.0.1:8000"' not in m.render()
    assert b'endpoint="http://10.0.0.2:8000"' in m.render()


class _Task310(asyncio.tasks._PyTask):
    """An asyncio Task as on Python 3.10: no ``uncancel``."""

    def __getattribute__(self, name):
        if name == "uncancel":
            raise AttributeError("'Task' object has no attribute 'uncancel' (Python 3.10)")
        return super().__getattribute__(name)


async def test_client_disconnect_without_task_uncancel(pods):
    pod, srv = pods[0]
    pod.state.stream_chunks, pod.state.chunk_delay = 50, 0.1
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()
    loop.set_task_factory(lambda lp, coro, **kw: _Task310(coro, loop=lp, **kw))
    app = RouterApp(RouterConfig(workers=(srv.url,), policy="round-robin", health_interval=60))
    try:
        await app.startup()
        gone = asyncio.Event()
        sent: list[dict] = []
        body = json.dumps({"prompt": "hi", "stream": True}).encode()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if incoming:
                return incoming.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg.get("body"):
                gone.set()  # the client leaves after the first chunk

        scope = {"type": "http", "path": "/v1/completions", "method": "POST",
                 "headers": [(b"content-type", b"application/json")]}
        await asyncio.wait_for(loop.create_task(app.http(scope, receive, send)), 30)
        for _ in range(250):
            if pod.state.disconnects:
                break
            await asyncio.sleep(0.02)
        assert pod.state.disconnects == 1 and app.active == 0
        assert b'pdserve_router_requests_total{outcome="cancelled"} 1.0' in app.metrics.render()
    finally:
        loop.set_task_factory(factory)
        await app.shutdown()


def test_pdserve_up_api_key_protects_the_pods_and_the_router_presents_it(tmp_path):
    import argparse

    from pdserve import up

    parser = argparse.ArgumentParser().add_subparsers()
    up.add_parser(parser)
    args = parser.choices["up"].parse_args(["--api-key", "k3y", "--kv-connector", "disk"])
    children = up.build_children(args, tmp_path, "/models/smol")
    *pods, router = children
    assert all(p.env["PDSERVE_API_KEY"] == "k3y" for p in pods) and len(pods) == 2
    # the router presents the pods' key and signs prefill handoffs with the pods' KV secret; nothing else
    assert router.env == {"PDSERVE_UPSTREAM_API_KEY": "k3y", "PDSERVE_KV_TOKEN": pods[0].env["PDSERVE_KV_TOKEN"]}
    assert not any("k3y" in a for p in pods for a in p.argv)  # env only: never on a pod's command line
