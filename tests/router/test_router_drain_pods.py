"""Graceful drain and safe rollouts with real pdserve pods (default model, CPU, NIXL over loopback) behind the router:

- SIGTERM to a pod under steady streaming load: zero failed requests, every answer the greedy reference; the router
  learns from the pod's 503 + ``x-pdserve-draining`` (its health checks are made too slow to explain it).
- SIGTERM to a prefill pod whose KV a decode pod has not pulled yet: the prefill pod stays up, serving its leased
  blocks, until decode pulled them (no KV load failure, no recompute), then exits 0.
- Two KV fingerprints (block size 16 vs 32): the router never hands a prefill of one to a decode of the other, and
  falls back to decode-only when no compatible prefill pod is left; no failed request.

Pods: P16 and P32 (prefill), D16 (decode), B16 (role both, the one drained under load). Runs in this order.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.kv_connectors import kv_auth
from pdserve.router.config import RouterConfig
from pdserve.router.pd import REMOTE_DECODE_PARAMS
from pdserve.runtime.metrics import parse_samples
from tests.support.server import free_port, launch_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STORY = "Write a long story about a dragon who loves tea and lives in a quiet mountain village. " * 5
GREEDY = {"temperature": 0, "max_tokens": 8}
GRACE = 60.0


def metric(url: str, name: str) -> float:
    samples = parse_samples(httpx.get(url + "/metrics", timeout=10).text)
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Pods(dict):
    """The pod handles by name, plus the deployment's KV secret (a handoff to a prefill pod must be signed with it)."""

    def __init__(self, handles: dict, token: str):
        super().__init__(handles)
        self.token = token


@pytest.fixture(scope="module")
def pods():
    token = secrets.token_hex(16)
    # float32: answers under load (batched) must equal the unbatched reference; bf16 (the CPU default where the CPU
    # has AVX512-BF16/AMX) is not batch-invariant
    common = ["--num-gpu-blocks", "300", "--max-model-len", "1024", "--max-num-seqs", "8", "--dtype", "float32",
              "--shutdown-grace-period", str(GRACE)]

    def nixl(block: int, role: str) -> list[str]:
        conf = {"host": "127.0.0.1", "port": free_port(), "lease_s": 60}
        return ["--role", role, "--block-size", str(block), "--kv-connector", "nixl",
                "--kv-connector-config", json.dumps(conf)]

    specs = {"P16": nixl(16, "prefill"), "P32": nixl(32, "prefill"), "D16": nixl(16, "decode"),
             "B16": ["--block-size", "16"]}
    cms = {n: launch_server(*common, *a, env={"PDSERVE_KV_TOKEN": token}, stop_timeout=GRACE + 10)
           for n, a in specs.items()}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(cms)) as ex:
        futures = {n: ex.submit(cm.__enter__) for n, cm in cms.items()}
        handles = {}
        for n, f in futures.items():
            handles[n] = f.result()
            stack.push(cms[n].__exit__)
        yield Pods(handles, token)


@pytest.fixture(scope="module")
def reference(pods):
    c = openai.OpenAI(base_url=pods["B16"].url + "/v1", api_key="x")
    return {i: c.completions.create(model=MODEL, prompt=f"{i}. {STORY}", **GREEDY).choices[0].text for i in range(6)}


def test_prefill_pairs_only_with_its_fingerprint(pods, reference, make_router, tokenizer):
    P16, P32, D16 = pods["P16"], pods["P32"], pods["D16"]
    fps = {n: httpx.get(pods[n].url + "/health").json()["kv_fingerprint"] for n in ("P16", "P32", "D16")}
    assert fps["P16"] == fps["D16"] != fps["P32"]
    app, r = make_router(RouterConfig(prefill=(P32.url, P16.url), decode=(D16.url,), pd_threshold=16,
                                      policy="round-robin", kv_token=pods.token), tokenizer=tokenizer)
    wait_for(lambda: all(e.kv_fingerprint for e in app.pool), "fingerprints learned")
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0)
    for i in range(4):
        assert c.completions.create(model=MODEL, prompt=f"{i}. {STORY}", **GREEDY).choices[0].text == reference[i]
    assert metric(P32.url, "vllm:request_success_total") == 0  # never across fingerprints
    assert metric(P16.url, "vllm:request_success_total") >= 4
    assert metric(D16.url, "pdserve:kv_load_failures_total") == 0
    # only an incompatible prefill pod left: decode-only, still right
    app2, r2 = make_router(RouterConfig(prefill=(P32.url,), decode=(D16.url,), pd_threshold=16,
                                        policy="round-robin", kv_token=pods.token), tokenizer=tokenizer)
    wait_for(lambda: all(e.kv_fingerprint for e in app2.pool), "fingerprints learned")
    c2 = openai.OpenAI(base_url=r2.url + "/v1", api_key="x", max_retries=0)
    assert c2.completions.create(model=MODEL, prompt=f"4. {STORY}", **GREEDY).choices[0].text == reference[4]
    assert metric(P32.url, "vllm:request_success_total") == 0
    assert 'pdserve_router_pd_decisions_total{decision="local_no_prefill"} 1.0' in httpx.get(r2.url + "/metrics").text


def test_sigterm_to_prefill_keeps_leased_kv_until_decode_pulled_it(pods, reference):
    P16, D16 = pods["P16"], pods["D16"]
    failures = metric(D16.url, "pdserve:kv_load_failures_total")
    body = {"model": MODEL, "prompt": f"5. {STORY}", **GREEDY}
    raw = json.dumps({**body, "max_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}).encode()
    pre = httpx.post(P16.url + "/v1/completions", timeout=120, content=raw, headers={  # a handoff, as the router asks
        "content-type": "application/json", kv_auth.HANDOFF_HEADER: kv_auth.handoff_header(pods.token.encode(), raw)
    }).json()
    params = pre["kv_transfer_params"]
    assert params["lease_id"]
    P16.proc.send_signal(15)  # SIGTERM: the lease is held, nobody has pulled it yet
    wait_for(lambda: httpx.get(P16.url + "/health", timeout=5).status_code == 503, "prefill draining")
    r = httpx.post(P16.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.headers["x-pdserve-draining"] == "1"  # no new work
    assert P16.proc.poll() is None  # still serving its leased blocks
    out = httpx.post(D16.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120).json()
    assert out["choices"][0]["text"] == reference[5]
    assert metric(D16.url, "pdserve:kv_load_failures_total") == failures  # pulled, not recomputed
    assert P16.proc.wait(GRACE) == 0  # and exits once the lease is done, well within the grace period


def test_sigterm_to_a_pod_under_streaming_load_fails_nothing(pods, reference, make_router, tokenizer):
    B16, D16 = pods["B16"], pods["D16"]
    # health checks every 60 s: only the drain signal (or a refused connection) can take B16 out of rotation
    _, r = make_router(RouterConfig(decode=(B16.url, D16.url), policy="round-robin", health_interval=60.0),
                       tokenizer=tokenizer)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=120)
    results: list[tuple[int, str | None, str | None]] = []  # (prompt, text, error)
    stop = threading.Event()

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            i = (k + n) % 4
            n += 1
            try:
                stream = c.completions.create(model=MODEL, prompt=f"{i}. {STORY}", stream=True, **GREEDY)
                text = "".join(ch.choices[0].text for ch in stream if ch.choices)
                results.append((i, text, None))
            except Exception as e:  # noqa: BLE001 (any failure is what this test counts)
                results.append((i, None, repr(e)))

    with ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(client, k) for k in range(3)]
        wait_for(lambda: len(results) >= 3, "steady load", timeout=300)
        wait_for(lambda: metric(B16.url, "vllm:num_requests_running") > 0, "a stream in flight on B16", 120)
        B16.proc.send_signal(15)
        assert B16.proc.wait(GRACE) == 0
        done_at_exit = len(results)
        wait_for(lambda: len(results) >= done_at_exit + 3, "load served by the other pod", timeout=300)
        stop.set()
        for f in futures:
            f.result()
    assert [e for _, _, e in results if e] == []
    assert all(text == reference[i] for i, text, _ in results), results
    # B16 left the rotation on its first drain answer: at most one retry per client that raced into it, not one per
    # request until a health check or the circuit breaker noticed
    text = httpx.get(r.url + "/metrics").text
    retries = sum(v for k, v in parse_samples(text).items() if k.startswith("pdserve_router_retries_total"))
    assert retries <= 3, text
