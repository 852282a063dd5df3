"""The router and the pods' drain/rollout signals (runtime/drain.py, router/drain_signal.py), with fake pods on
loopback: a pod answering 503 + ``x-pdserve-draining`` leaves the very next pick (the health interval is made
long so only the signal can explain it), and P/D pairs only prefill and decode pods with equal KV fingerprints."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdserve.router.config import RouterConfig
from tests.router.fake_pod import FakePod, FakeState, ServerThread

LONG = "tell me a story about a dragon " * 40


class SignallingPod(FakePod):
    """A FakePod whose /health advertises a KV fingerprint and which can drain like a pdserve pod."""

    def __init__(self, name: str, fingerprint: str | None = None):
        super().__init__(FakeState(name=name))
        self.fingerprint, self.draining = fingerprint, False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (self.draining or scope["path"] == "/health"):
            if self.draining:
                body, status = b'{"error": {"message": "server is shutting down"}}', 503
                headers = [(b"x-pdserve-draining", b"1")]
                if scope["path"] != "/health":
                    self.state.count += 1
            else:
                body, status, headers = json.dumps({"status": "ok", "kv_fingerprint": self.fingerprint}).encode(), \
                    200, []
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
            await send({"type": "http.response.body", "body": body})
            return
        await super().__call__(scope, receive, send)


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def signalling_pods():
    started = []

    def make(*specs: tuple[str, str | None]) -> list[tuple[SignallingPod, ServerThread]]:
        out = [(p := SignallingPod(name, fp), ServerThread(p).start()) for name, fp in specs]
        started.extend(s for _, s in out)
        return out

    yield make
    for s in started:
        s.stop()


def test_a_draining_pod_leaves_the_next_pick_at_once(signalling_pods, make_router):
    (a, sa), (b, sb) = signalling_pods(("a", None), ("b", None))
    # health checks every 60 s: only the drain signal can take `a` out of rotation within this test
    _, r = make_router(RouterConfig(decode=(sa.url, sb.url), policy="round-robin", health_interval=60.0))
    with httpx.Client(base_url=r.url, timeout=30) as c:
        for _ in range(4):
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert a.state.count == 2 and b.state.count == 2  # round robin over both
        a.draining = True
        for _ in range(10):
            resp = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "from b"
    assert a.state.count == 3  # exactly one request met the draining pod, and it was retried on b
    assert b.state.count == 2 + 10


def test_pd_pairs_only_equal_fingerprints_and_falls_back_to_decode_only(signalling_pods, make_router, tokenizer):
    (old_p, so), (new_p, sn), (dec, sd) = signalling_pods(("old", "fp-old"), ("new", "fp-new"), ("d", "fp-new"))
    app, r = make_router(RouterConfig(prefill=(so.url, sn.url), decode=(sd.url,), pd_threshold=16,
                                      policy="round-robin"), tokenizer=tokenizer)
    wait_for(lambda: sorted(str(e.kv_fingerprint) for e in app.pool) == ["fp-new", "fp-new", "fp-old"],
             "fingerprints learned from /health")
    with httpx.Client(base_url=r.url, timeout=30) as c:
        for _ in range(6):
            assert c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 3}).status_code == 200
        assert old_p.state.requests == [] and len(new_p.state.requests) == 6  # never across fingerprints
        assert all("kv_transfer_params" in q["body"] for q in dec.state.requests)
        # the compatible prefill pod goes away: decode-only, no failures, still nothing to the old prefill pod
        sn.stop()
        wait_for(lambda: not app.pool.get(sn.url).healthy, "the stopped prefill pod marked unhealthy")
        for _ in range(3):
            assert c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 3}).status_code == 200
    assert old_p.state.requests == []
    assert [("kv_transfer_params" in q["body"]) for q in dec.state.requests[-3:]] == [False] * 3
    assert 'pdserve_router_pd_decisions_total{decision="local_no_prefill"} 3.0' in httpx.get(r.url + "/metrics").text
