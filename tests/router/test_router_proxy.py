"""The router in front of real HTTP fake pods on loopback: routing, SSE pass-through, P/D handoff, prefill failure
semantics, retries, circuit breaker, cancellation, admission limits, health, metrics, and the CLI."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import openai
import pytest

from pdserve.router.config import RouterConfig
from pdserve.runtime.metrics import parse_samples
from tests.router.fake_pod import FakePod, FakeState, ServerThread
from tests.support.server import free_port, launch_process

LONG = "The quick brown fox jumps over the lazy dog. " * 40   # ~400 tokens


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.02)


def urls(pods, idx):
    return tuple(pods[i][1].url for i in idx)


def test_round_robin_passthrough_and_request_id(pods, make_router):
    app, r = make_router(RouterConfig(workers=urls(pods, [0, 1, 2]), policy="round-robin"))
    with httpx.Client(base_url=r.url) as c:
        texts = [c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["choices"][0]["text"]
                 for _ in range(6)]
        resp = c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "abc-1"})
    assert sorted(texts) == sorted(["from p0", "from p1", "from p2"] * 2)
    assert resp.headers["x-request-id"] == "abc-1"
    assert any(q["headers"].get("x-request-id") == "abc-1" for p, _ in pods for q in p.state.requests)
    assert all(p.state.count >= 2 for p, _ in pods)


def test_sse_is_passed_through_chunk_by_chunk(pods, make_router):
    pod = pods[0][0]
    pod.state.stream_chunks, pod.state.chunk_delay = 4, 0.5
    _, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin"))
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="x")
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], stream=True)
    first = next(iter(stream))
    # the first chunk reached us while the pod still had chunks to write: nothing was buffered
    assert first.choices[0].delta.content == "p0-0 " and pod.state.sent_chunks < 4
    rest = [c.choices[0].delta.content for c in stream]
    assert rest == ["p0-1 ", "p0-2 ", "p0-3 "]


def test_pd_handoff_copies_kv_transfer_params(pods, make_router, tokenizer):
    (prefill, ps), (decode, ds) = pods[0], pods[1]
    app, r = make_router(RouterConfig(prefill=(ps.url,), decode=(ds.url,), pd_threshold=16, policy="round-robin"),
                         tokenizer=tokenizer)
    body = {"model": "fake", "messages": [{"role": "user", "content": LONG}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 7}
    with httpx.Client(base_url=r.url) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            lines = [l for l in s.iter_lines() if l]
    assert lines[-1] == "data: [DONE]" and "p1-0" in lines[0]
    (p_req,), (d_req,) = prefill.state.requests, decode.state.requests
    pb = p_req["body"]
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "stream_options" not in pb
    assert pb["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    db = d_req["body"]
    assert db["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                        "remote_block_ids": [1, 2, 3], "remote_engine_id": "engine-p0",
                                        "remote_request_id": p_req["headers"]["x-request-id"],
                                        "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
    assert db["stream"] is True and db["max_tokens"] == 7 and db["stream_options"] == {"include_usage": True}
    assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"]
    # a short prompt stays on decode
    with httpx.Client(base_url=r.url) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert len(prefill.state.requests) == 1 and "kv_transfer_params" not in decode.state.requests[-1]["body"]
    text = httpx.get(r.url + "/metrics").text
    assert 'pdserve_router_pd_decisions_total{decision="disaggregated"} 1.0' in text
    assert 'pdserve_router_pd_decisions_total{decision="local_short"} 1.0' in text


def test_pd_prefill_computes_one_sample_decode_keeps_n(pods, make_router, tokenizer):
    """n (and best_of) only shape decode's sampling: the prefill is asked for one sample, so the prompt's KV is
    handed off under one lease and moved once; decode still gets the client's n."""
    (prefill, ps), (decode, ds) = pods[0], pods[1]
    _, r = make_router(RouterConfig(prefill=(ps.url,), decode=(ds.url,), pd_threshold=16, policy="round-robin"),
                       tokenizer=tokenizer)
    with httpx.Client(base_url=r.url) as c:
        assert c.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": LONG}],
                                                    "n": 4, "seed": 3, "max_tokens": 5}).status_code == 200
        comp = {"prompt": LONG, "n": 3, "best_of": 3, "max_tokens": 5}
        assert c.post("/v1/completions", json=comp).status_code == 200
    (chat_p, comp_p), (chat_d, comp_d) = [q["body"] for q in prefill.state.requests], [q["body"] for q in
                                                                                       decode.state.requests]
    assert chat_p["n"] == 1 and chat_p["max_tokens"] == 1 and chat_p["seed"] == 3
    assert comp_p["n"] == 1 and "best_of" not in comp_p and comp_p["max_tokens"] == 1
    assert chat_d["n"] == 4 and comp_d["n"] == 3 and comp_d["best_of"] == 3 and chat_d["max_tokens"] == 5
    assert chat_d["kv_transfer_params"]["do_remote_prefill"] and comp_d["kv_transfer_params"]["do_remote_prefill"]


def test_prefill_failure_retries_another_prefill_then_falls_back(pods, make_router, tokenizer):
    (p0, s0), (p1, s1), (d, sd) = pods
    cfg = RouterConfig(prefill=(s0.url, s1.url), decode=(sd.url,), pd_threshold=16, policy="round-robin",
                       cb_failure_threshold=100)
    _, r = make_router(cfg, tokenizer=tokenizer)
    body = {"prompt": LONG, "max_tokens": 3}
    p0.state.status = 500
    with httpx.Client(base_url=r.url) as c:
        for _ in range(2):  # round robin puts p0 first at least once
            assert c.post("/v1/completions", json=body).status_code == 200
        assert all("remote_block_ids" in q["body"]["kv_transfer_params"] for q in d.state.requests)
        assert len(p0.state.requests) >= 1 and len(p1.state.requests) == 2   # p0 failed over to p1

        p1.state.kv_params = False  # p1 answers 200 but without kv_transfer_params: also a failure
        d.state.requests.clear()
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "from p2"
        assert "kv_transfer_params" not in d.state.requests[-1]["body"]      # decode-only fallback
    text = httpx.get(r.url + "/metrics").text
    assert 'pdserve_router_pd_fallbacks_total{action="decode_only"} 1.0' in text
    assert parse_samples(text)['pdserve_router_pd_fallbacks_total{action="retry_prefill"}'] >= 1  # exists from 0


def test_prefill_failure_policy_fail(pods, make_router, tokenizer):
    (p0, s0), (d, sd) = pods[0], pods[2]
    p0.state.status = 503
    _, r = make_router(RouterConfig(prefill=(s0.url,), decode=(sd.url,), pd_threshold=16, policy="round-robin",
                                    prefill_failure="fail"), tokenizer=tokenizer)
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": LONG})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "prefill_failed"
    assert not d.state.requests
    # a client error from prefill is relayed as is, not retried or masked
    p0.state.status = 400
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": LONG})
    assert resp.status_code == 400 and "error" in resp.json()


def test_retries_before_first_byte_and_circuit_breaker(pods, make_router):
    (bad, sb), (good, sg) = pods[0], pods[1]
    bad.state.status = 503
    doomed = ServerThread(FakePod(FakeState(name="doomed"))).start()
    dead = doomed.url
    app, r = make_router(RouterConfig(workers=(sb.url, sg.url, dead), policy="round-robin", cb_failure_threshold=2,
                                      cb_open_seconds=1.0, health_interval=60))
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    doomed.stop()  # healthy at the router's first check, gone now: connect errors (no active check for 60 s)
    with httpx.Client(base_url=r.url) as c:
        for _ in range(9):
            resp = c.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "from p1"
    assert app.pool.get(sb.url).breaker.state in ("open", "half_open")
    assert app.pool.get(dead).breaker.state in ("open", "half_open")
    n_bad = bad.state.count
    assert n_bad == 2  # open after two failures: no more traffic to it
    bad.state.status = 200
    time.sleep(1.1)      # cool-down over: the next request may probe the pod again
    with httpx.Client(base_url=r.url) as c:
        texts = {c.post("/v1/completions", json={"prompt": "hi"}).json()["choices"][0]["text"] for _ in range(6)}
    assert "from p0" in texts and app.pool.get(sb.url).breaker.state == "closed"
    assert parse_samples(httpx.get(r.url + "/metrics").text)['pdserve_router_retries_total{role="decode"}'] >= 1


def test_all_pods_failing_returns_the_error(pods, make_router):
    pods[0][0].state.status = 500
    _, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin", max_retries=1))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 500 and resp.json()["error"]["message"] == "p0 failing"
    doomed = ServerThread(FakePod(FakeState(name="doomed"))).start()
    app, r2 = make_router(RouterConfig(workers=(doomed.url,), policy="round-robin", health_interval=60))
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    doomed.stop()
    resp = httpx.post(r2.url + "/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "upstream_error"
    app, r3 = make_router(RouterConfig(workers=(f"http://127.0.0.1:{free_port()}",), policy="round-robin"))
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    resp = httpx.post(r3.url + "/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable"


async def test_client_disconnect_cancels_upstream(pods, make_router):
    pod = pods[0][0]
    pod.state.stream_chunks, pod.state.chunk_delay = 50, 0.2
    app, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin"))
    async with httpx.AsyncClient(base_url=r.url) as c:
        async with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as s:
            async for line in s.aiter_lines():
                if line:
                    break
    for _ in range(250):
        if pod.state.disconnects:
            break
        await asyncio.sleep(0.02)
    assert pod.state.disconnects == 1 and pod.state.sent_chunks < 50
    assert app.pool.get(pods[0][1].url).in_flight == 0 and app.active == 0
    assert 'pdserve_router_requests_total{outcome="cancelled"} 1.0' in httpx.get(r.url + "/metrics").text


def test_admission_limits(pods, make_router):
    pods[0][0].state.delay = 1.0
    _, r = make_router(RouterConfig(workers=urls(pods, [0]), policy="round-robin", api_key="sekret",
                                    max_concurrency=1, max_body_bytes=1000))
    auth = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=r.url, timeout=30) as c:
        resp = c.post("/v1/completions", json={"prompt": "hi"})
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"}).status_code == 401
        resp = c.post("/v1/completions", json={"prompt": "x" * 2000}, headers=auth)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        resp = c.post("/v1/completions", content=b"{not json", headers=auth)
        assert resp.status_code == 400 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert c.post("/v1/completions", content=b"[1, 2]", headers=auth).status_code == 400
        assert c.get("/v1/nope", headers=auth).status_code == 404
        assert c.get("/v1/completions", headers=auth).status_code == 405
        assert c.get("/health").status_code == 200   # health and metrics need no key

        import threading
        slow = threading.Thread(target=lambda: httpx.post(r.url + "/v1/completions", json={"prompt": "a"},
                                                          headers=auth, timeout=30))
        slow.start()
        wait_for(lambda: pods[0][0].state.count >= 1, what="slow request in flight")
        resp = c.post("/v1/completions", json={"prompt": "b"}, headers=auth)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        slow.join()
        assert c.post("/v1/completions", json={"prompt": "c"}, headers=auth).status_code == 200


def test_active_health_checks_and_no_endpoint(pods, make_router):
    (a, sa), (b, sb) = pods[0], pods[1]
    app, r = make_router(RouterConfig(workers=(sa.url, sb.url), policy="round-robin", health_interval=0.1))
    a.state.healthy = False
    wait_for(lambda: not app.pool.get(sa.url).healthy, what="pod marked unhealthy")
    with httpx.Client(base_url=r.url) as c:
        assert {c.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] for _ in range(4)} == {"from p1"}
        b.state.healthy = False
        wait_for(lambda: not app.pool.get(sb.url).healthy, what="second pod unhealthy")
        resp = c.post("/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
        assert c.get("/health").json() == {"status": "ok", "endpoints": 2, "routable": 0}
        a.state.healthy = True
        wait_for(lambda: app.pool.get(sa.url).healthy, what="pod healthy again")
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_load_scraped_from_pod_metrics(pods, make_router):
    (a, sa), (b, sb) = pods[0], pods[1]
    a.state.waiting, a.state.kv_usage = 7, 0.9
    app, r = make_router(RouterConfig(workers=(sa.url, sb.url), policy="least-loaded", health_interval=0.1))
    wait_for(lambda: app.pool.get(sa.url).waiting == 7 and app.pool.get(sa.url).kv_usage == 0.9, what="scrape")
    with httpx.Client(base_url=r.url) as c:
        assert {c.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] for _ in range(3)} == {"from p1"}


def test_session_affinity(pods, make_router):
    _, r = make_router(RouterConfig(workers=urls(pods, [0, 1, 2]), policy="session-affinity"))
    with httpx.Client(base_url=r.url) as c:
        for user in ("alice", "bob", "carol"):
            got = {c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Session-Id": user})
                   .json()["choices"][0]["text"] for _ in range(4)}
            assert len(got) == 1


def test_precise_prefix_keeps_a_prefix_on_one_pod_and_spreads_others(pods, make_router, tokenizer):
    app, r = make_router(RouterConfig(workers=urls(pods, [0, 1, 2]), policy="precise-prefix"), tokenizer=tokenizer)
    with httpx.Client(base_url=r.url) as c:
        sys_a = [{"role": "system", "content": LONG}, {"role": "user", "content": "q1"}]
        first = c.post("/v1/chat/completions", json={"messages": sys_a}).json()["choices"][0]["message"]["content"]
        for q in ("q2", "q3"):
            m = [sys_a[0], {"role": "user", "content": q}]
            assert c.post("/v1/chat/completions", json={"messages": m}).json()["choices"][0]["message"]["content"] == first
    assert app.metrics.prefix_hit_ratio() > 0.5


def test_cli_subprocess(pods):
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port), "--policy",
           "round-robin", "--worker", pods[0][1].url, "--worker", pods[1][1].url, "--api-key", "k"]
    with launch_process(cmd, port, timeout=60) as h:
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="k")
        out = {c.completions.create(model="fake", prompt="hi").choices[0].text for _ in range(2)}
        assert out == {"from p0", "from p1"}
        assert [m.id for m in c.models.list()] == ["fake"]
