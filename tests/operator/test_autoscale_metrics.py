"""Metric windows from the runtime's real exposition (runtime/metrics.ServerMetrics), and PDBs from the builders."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from pdserve.operator.autoscale_metrics import Windows, parse, scrape
from pdserve.operator.reconcile import Observed, reconcile
from pdserve.runtime.metrics import ServerMetrics


def exposition(m: ServerMetrics, prompt_tokens: int, waiting: int, kv: float) -> str:
    m.set_engine_stats(SimpleNamespace(num_running=1, num_waiting=waiting, kv_cache_usage=kv,
                                       prompt_tokens=prompt_tokens, generation_tokens=0))
    return m.render().decode()


def test_window_is_the_delta_over_the_window_not_the_lifetime():
    m, w = ServerMetrics("smol"), Windows()
    for _ in range(100):  # lifetime before the window: fast first tokens
        m.ttft.observe(0.05)
    w.record("pod-a", parse(exposition(m, 10_000, 0, 0.1), t=0.0), window_s=10)
    for _ in range(10):  # inside the window: slow ones
        m.ttft.observe(3.0)
        m.request_finished("stop")
    w.record("pod-a", parse(exposition(m, 12_000, 4, 0.5), t=10.0), window_s=10)
    pool = w.pool(["pod-a"], replicas=1, ready=1, now=10.0)
    assert pool.pods_scraped == 1 and pool.ttft.count == 10
    assert pool.ttft.quantile(0.9) == pytest.approx(2.5 + 2.5 * 0.9)  # all 10 in (2.5, 5]: the lifetime p90 is 0.05
    assert pool.prompt_tokens_per_s == pytest.approx(200.0)  # (12000 - 10000) / 10 s
    assert pool.requests == 10 and pool.waiting == 4 and pool.kv_cache_usage == pytest.approx(0.5)


def test_window_slides_restarts_count_from_zero_and_stale_pods_are_left_out():
    m, w = ServerMetrics("smol"), Windows()
    for t, tokens in ((0, 0), (5, 500), (10, 1000), (15, 1500)):
        w.record("a", parse(exposition(m, tokens, 0, 0.0), t=float(t)), window_s=10)
    assert [s.t for s in w.samples["a"]] == [5.0, 10.0, 15.0]  # one sample at the window's start is kept
    assert w.pool(["a"], 1, 1, now=15.0).prompt_tokens_per_s == pytest.approx(100.0)
    w.record("a", parse(exposition(ServerMetrics("smol"), 300, 0, 0.0), t=20.0), window_s=10)  # restarted pod
    assert w.pool(["a"], 1, 1, now=20.0).prompt_tokens_per_s == pytest.approx(300 / 10)
    # a pod that did not answer this round (latest sample older than now) is not counted
    assert w.pool(["a"], 1, 1, now=25.0).pods_scraped == 0
    w.forget_except(set())
    assert w.samples == {}


async def test_scrape_real_http_with_timeout_and_garbage():
    m = ServerMetrics("smol")
    text = exposition(m, 42, 1, 0.25)

    async def ok(_):
        return web.Response(text=text)

    async def slow(_):
        await asyncio.sleep(1.5)
        return web.Response(text=text)

    async def garbage(_):
        return web.Response(text="vllm:num_requests_waiting{ not prometheus")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/slow", slow)
    app.router.add_get("/garbage", garbage)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as s:
            sample = await scrape(s, f"http://127.0.0.1:{port}/ok", 1.0)
            assert sample.values["prompt_tokens"] == 42 and sample.values["kv_cache_usage"] == 0.25
            assert await scrape(s, f"http://127.0.0.1:{port}/slow", 1.0, timeout=0.3) is None
            assert await scrape(s, f"http://127.0.0.1:{port}/garbage", 1.0) is None
            assert await scrape(s, f"http://127.0.0.1:{port}/missing", 1.0) is None
    finally:
        await runner.cleanup()


def test_a_pdb_per_pool_selecting_exactly_its_pods_and_pruned_with_the_pool():
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": {"name": "smol"}, "prefill": {"replicas": 2}, "decode": {"replicas": 3}}}
    pdbs = {o["metadata"]["name"]: o for o in reconcile(body, Observed()).objects
            if o["kind"] == "PodDisruptionBudget"}
    assert sorted(pdbs) == ["m-decode", "m-prefill", "m-router"]
    for role in ("prefill", "decode"):
        assert pdbs[f"m-{role}"]["spec"]["maxUnavailable"] == 1
        assert pdbs[f"m-{role}"]["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "m",
            "app.kubernetes.io/component": "runtime", "pdserve.dev/role": role}
    del body["spec"]["prefill"]
    r = reconcile(body, Observed(pdbs={"m-prefill": {}, "m-decode": {}}))
    assert ("PodDisruptionBudget", "m-prefill") in r.prune and ("PodDisruptionBudget", "m-decode") not in r.prune
