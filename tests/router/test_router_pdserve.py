"""The router in front of real pdserve pods (default model, CPU): P/D handoff through the disk connector with greedy
output equal to a monolithic pod, prefix routing from the pods' real KV events, cancellation, fallback when the
prefill pod dies, and interop with the Rust ``vllm-router`` in ``--vllm-pd-disaggregation`` mode.

One module-scoped set of pods: M (both), P (prefill), D (decode); P and D share a disk-connector directory.
The fallback test kills P, so it runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.router.config import KVEventSource, RouterConfig
from tests.support.server import free_port, launch_process, launch_server

pytestmark = pytest.mark.slow

STORY = "Write a long story about a dragon who loves tea and lives in a quiet mountain village. " * 6
MESSAGES = [{"role": "system", "content": "You are a concise storyteller."}, {"role": "user", "content": STORY}]
GREEDY = {"temperature": 0, "max_tokens": 12}


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    conn = json.dumps({"path": str(tmp_path_factory.mktemp("kv"))})
    common = ["--num-gpu-blocks", "400", "--max-model-len", "2048", "--max-num-seqs", "16"]
    ports = {name: (free_port(), free_port()) for name in "MPD"}
    events = lambda n: ["--kv-events-port", str(ports[n][0]), "--kv-events-replay-port", str(ports[n][1])]  # noqa: E731
    specs = {"M": common + events("M"),
             "P": common + events("P") + ["--role", "prefill", "--kv-connector", "disk", "--kv-connector-config", conn],
             "D": common + events("D") + ["--role", "decode", "--kv-connector", "disk", "--kv-connector-config", conn]}
    cms = {n: launch_server(*a) for n, a in specs.items()}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as ex:
        futures = {n: ex.submit(cm.__enter__) for n, cm in cms.items()}
        handles = {}
        for n, f in futures.items():
            handles[n] = f.result()
            stack.push(cms[n].__exit__)
        for n, h in handles.items():
            h.kv_source = KVEventSource(f"tcp://127.0.0.1:{ports[n][0]}", f"tcp://127.0.0.1:{ports[n][1]}")
        handles["P"].launch_args = common + ["--role", "prefill", "--kv-connector", "disk", "--kv-connector-config", conn]
        yield handles


@pytest.fixture(scope="module")
def reference(cluster):
    """Greedy answers of the monolithic pod."""
    c = openai.OpenAI(base_url=cluster["M"].url + "/v1", api_key="x")
    chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
    comp = c.completions.create(model="SmolLM2-135M-Instruct", prompt=STORY, **GREEDY)
    return chat.choices[0].message.content, comp.choices[0].text


def test_router_tokenization_matches_the_pod(cluster, tokenizer):
    url = cluster["M"].url
    for path, body, req in (("/v1/chat/completions", {"messages": MESSAGES}, {"messages": MESSAGES}),
                            ("/v1/completions", {"prompt": STORY}, {"prompt": STORY})):
        pod = httpx.post(url + "/tokenize", json=req, timeout=60).json()["tokens"]
        assert tokenizer.token_ids(path, body) == pod


def test_pd_handoff_matches_monolithic(cluster, reference, make_router, tokenizer):
    P, D = cluster["P"], cluster["D"]
    app, r = make_router(RouterConfig(prefill=(P.url,), decode=(D.url,), pd_threshold=32, request_timeout=120),
                         tokenizer=tokenizer)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=120)
    chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == reference[0]
    assert chat.usage.prompt_tokens_details.cached_tokens > 0          # decode loaded the prompt's KV, did not recompute
    stream = c.completions.create(model="SmolLM2-135M-Instruct", prompt=STORY, stream=True, **GREEDY)
    chunks = [ch.choices[0].text for ch in stream if ch.choices]
    assert len(chunks) > 1 and "".join(chunks) == reference[1]
    m = httpx.get(r.url + "/metrics").text
    assert 'pdserve_router_pd_decisions_total{decision="disaggregated"} 2.0' in m


def test_pd_n_samples_move_the_prompt_kv_once(cluster, make_router, tokenizer):
    """n=3 through router -> prefill -> decode: the prefill pod computes one sample, the decode pod loads the prompt's
    KV once (child 0; its siblings hit the prefix cache) and every choice equals the monolithic pod's greedy answer."""
    P, D, M = cluster["P"], cluster["D"], cluster["M"]
    messages = [{"role": "user", "content": "Describe a lighthouse keeper's evening routine on a stormy island. " * 4}]
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "n": 3, **GREEDY}
    want = httpx.post(M.url + "/v1/chat/completions", json=body, timeout=120).json()
    app, r = make_router(RouterConfig(prefill=(P.url,), decode=(D.url,), pd_threshold=32, request_timeout=120),
                         tokenizer=tokenizer)
    loads, failures = (metric(D.url, f"pdserve:kv_connector_{m}_total") for m in ("loads", "load_failures"))
    p_prompt = metric(P.url, "vllm:prompt_tokens_total")
    got = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert [c["message"]["content"] for c in got["choices"]] == [c["message"]["content"] for c in want["choices"]]
    assert len(got["choices"]) == 3 and got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert metric(D.url, "pdserve:kv_connector_loads_total") - loads == 1
    assert metric(D.url, "pdserve:kv_connector_load_failures_total") == failures
    assert metric(P.url, "vllm:prompt_tokens_total") - p_prompt <= want["usage"]["prompt_tokens"]   # computed once


def test_precise_prefix_routing_from_real_kv_events(cluster, make_router, tokenizer):
    M, D = cluster["M"], cluster["D"]
    cfg = RouterConfig(workers=(M.url, D.url), policy="precise-prefix", speculative_ttl=0.0, request_timeout=120,
                       kv_event_sources={M.url: M.kv_source, D.url: D.kv_source})
    app, r = make_router(cfg, tokenizer=tokenizer)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=120)
    system = "You are a tea-loving dragon. Answer every question about tea in great detail. " * 5

    def ask(q: str):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        return c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=2, temperature=0)

    ask("What is green tea?")
    ids = tokenizer.token_ids("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                                    {"role": "user", "content": "x"}]})
    from pdserve.router.prompt import block_hashes
    hashes = block_hashes(ids, 16, None)[:-1]  # the shared system-prompt blocks
    # the pod that served it published BlockStored events: the index (no speculative entries here) knows it
    wait_for(lambda: max(app.index.match(hashes, [M.url, D.url]).values()) >= len(hashes) - 1, what="KV events")
    held = app.index.match(hashes, [M.url, D.url])
    owner = max(held, key=held.get)
    assert held[owner] >= len(hashes) - 1 and min(held.values()) == 0
    before = app.metrics.decisions.labels("decode", owner)._value.get()
    for q in ("How is oolong made?", "Why is matcha green?"):
        assert ask(q).usage.prompt_tokens_details.cached_tokens >= 16 * (len(hashes) - 1)
    assert app.metrics.decisions.labels("decode", owner)._value.get() == before + 2
    assert app.metrics.prefix_hit_ratio() > 0.3


def test_retry_on_another_pod_before_the_first_byte(cluster, reference, make_router):
    """A pod that dies after passing its health check: the request is retried on the real pod and answered right."""
    from tests.router.fake_pod import FakePod, FakeState, ServerThread

    doomed = ServerThread(FakePod(FakeState(name="doomed"))).start()
    app, r = make_router(RouterConfig(workers=(doomed.url, cluster["M"].url), policy="round-robin",
                                      health_interval=60, request_timeout=120))
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    doomed.stop()
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=120)
    for _ in range(2):  # round robin: one of the two goes to the dead pod first
        chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
        assert chat.choices[0].message.content == reference[0]
    assert app.metrics.retries.labels("decode")._value.get() >= 1
    assert app.pool.get(doomed.url).breaker.failures >= 1


async def test_client_disconnect_aborts_on_the_pod(cluster, make_router):
    M = cluster["M"]
    app, r = make_router(RouterConfig(workers=(M.url,), policy="round-robin"))

    def aborted() -> float:
        text = httpx.get(M.url + "/metrics").text
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                   if l.startswith("pdserve:requests_aborted_on_disconnect_total"))

    start = aborted()
    async with httpx.AsyncClient(base_url=r.url, timeout=60) as c:
        body = {"prompt": STORY, "max_tokens": 400, "stream": True, "temperature": 0}
        async with c.stream("POST", "/v1/completions", json=body) as s:
            async for line in s.aiter_lines():
                if line.startswith("data:"):
                    break
    await asyncio.to_thread(wait_for, lambda: aborted() > start, 30, "pod aborted the request")
    await asyncio.to_thread(wait_for, lambda: "vllm:num_requests_running{model_name=\"SmolLM2-135M-Instruct\"} 0.0"
                            in httpx.get(M.url + "/metrics").text, 30, "pod idle")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " "))


def test_vllm_router_pd_interop(cluster):
    """The Rust vllm-router drives pdserve prefill/decode pods by the same protocol (fresh prompt: no cache hits).

    The secure setup (README, "Security of the KV path"): prefill pods run with ``--api-key``, which vllm-router sends
    to the pods as ``Authorization: Bearer $OPENAI_API_KEY``; the pods' signed kv_transfer_params pass through it
    verbatim and the decode pod verifies them. Without the key the prefill pod refuses the handoff (403)."""
    msgs = [{"role": "user", "content": "Describe, step by step, how a lighthouse keeper prepares for a storm. " * 5}]
    ref = openai.OpenAI(base_url=cluster["M"].url + "/v1", api_key="x", timeout=120).chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, **GREEDY).choices[0].message.content
    key = "prefill-pods-key"
    with launch_server(*cluster["P"].launch_args, "--api-key", key) as prefill:
        failures = metric(cluster["D"].url, "pdserve:kv_load_failures_total")
        loaded = metric(cluster["D"].url, "pdserve:kv_connector_blocks_loaded_total")
        exe = shutil.which("vllm-router") or str(__import__("pathlib").Path(sys.executable).parent / "vllm-router")
        port = free_port()
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--prefill",
               prefill.url, "--decode", cluster["D"].url, "--policy", "round_robin", "--log-level", "warning",
               "--prometheus-port", str(free_port())]   # not its fixed default, 29000
        with launch_process(cmd, port, timeout=120, env={"OPENAI_API_KEY": key}) as h:
            c = openai.OpenAI(base_url=h.url + "/v1", api_key="x", timeout=120)
            chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, **GREEDY)
            assert chat.choices[0].message.content == ref
            # The prefill pod prefilled it and D loaded its KV without failures. (vllm-router rewrites ``usage`` from
            # the prefill's answer, so cached_tokens in its response is the prefill's 0, not the decode pod's count.)
            assert metric(prefill.url, "vllm:request_success_total") == 1
            assert metric(cluster["D"].url, "pdserve:kv_load_failures_total") == failures
            assert metric(cluster["D"].url, "pdserve:kv_connector_blocks_loaded_total") > loaded


def test_decode_kv_load_failure_still_answers_correctly(cluster, reference, make_router, tokenizer):
    """A prefill pod hands over blocks that are not in the store (a stand-in for a lost transfer): the decode pod's
    load fails, it recomputes, and the client still gets the monolithic pod's greedy answer."""
    from pdserve.router.prompt import block_hashes
    from tests.router.fake_pod import FakePod, FakeState, ServerThread

    D = cluster["D"]
    ids = tokenizer.token_ids("/v1/chat/completions", {"messages": MESSAGES})
    from pdserve.kv_connectors import kv_auth

    lost = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone", "tp_size": 1,
            "remote_block_ids": list(range(len(ids) // 16)), "remote_request_id": "x", "remote_host": None,
            "remote_port": None, "connector": "disk",
            "block_hashes": [h.hex() for h in block_hashes(ids, 16, "lost-blocks")]}
    lost = kv_auth.sign_params(lost, os.environ["PDSERVE_KV_TOKEN"].encode(), 600)   # a prefill of this deployment
    # salted hashes never exist in the store; send the same salt so the decode pod's own hashes match them
    with ServerThread(FakePod(FakeState(name="lossy", kv_params_value=lost))) as fake:
        app, r = make_router(RouterConfig(prefill=(fake.url,), decode=(D.url,), pd_threshold=32, request_timeout=120),
                             tokenizer=tokenizer)
        failures = metric(D.url, "pdserve:kv_load_failures_total")
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=120)
        chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY,
                                         extra_body={"cache_salt": "lost-blocks"})
    assert chat.choices[0].message.content == reference[0]
    assert metric(D.url, "pdserve:kv_load_failures_total") > failures


def test_fallback_to_decode_when_prefill_dies(cluster, reference, make_router, tokenizer):
    P, D = cluster["P"], cluster["D"]
    app, r = make_router(RouterConfig(prefill=(P.url,), decode=(D.url,), pd_threshold=32, request_timeout=120,
                                      health_interval=60), tokenizer=tokenizer)
    wait_for(lambda: app.health.rounds >= 1, what="first health round")
    P.terminate()  # the router still believes P healthy: the prefill attempt fails on connect
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", timeout=120)
    chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == reference[0]
    assert 'pdserve_router_pd_fallbacks_total{action="decode_only"} 1.0' in httpx.get(r.url + "/metrics").text
