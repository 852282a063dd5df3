"""The router and LoRA adapters, over real HTTP against fake pods: the health loop scrapes
``vllm:lora_requests_info`` into each endpoint, the precise-prefix policy sends an adapter's requests to the pod that
has it resident, and ``/v1/models`` is the union of the pods' models (adapters differ per pod)."""

from __future__ import annotations

import httpx

from pdserve.router.config import RouterConfig
from tests.router.test_router_drain_pods import wait_for


def test_adapter_requests_go_to_the_pod_with_the_adapter(pods, make_router):
    (a, sa), (b, sb) = pods[0], pods[1]
    a.state.models, b.state.models = ("fake", "sql"), ("fake", "chat")
    a.state.lora_info = 'max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""'
    b.state.lora_info = 'max_lora="1",running_lora_adapters="chat",waiting_lora_adapters=""'
    app, r = make_router(RouterConfig(workers=(sa.url, sb.url), policy="precise-prefix"))
    wait_for(lambda: app.pool.get(sa.url).lora_running == {"sql"} and app.pool.get(sb.url).max_loras == 1,
             what="lora_requests_info scrape")
    with httpx.Client(base_url=r.url, timeout=30) as c:
        for model, pod in [("chat", b), ("sql", a)] * 3:   # by chance: 1 in 64
            before = len(pod.state.requests)
            assert c.post("/v1/completions", json={"model": model, "prompt": "hi"}).status_code == 200
            assert len(pod.state.requests) == before + 1, model
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"fake", "sql", "chat"}
