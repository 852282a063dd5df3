"""The real `pdserve serve` (default model, CPU) driven by the official openai client and raw HTTP.

One module-scoped server carries the API, error, disconnect, metrics, KV-event and load tests.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import zmq

from pdserve.runtime.kv_event_publisher import END_SEQ, seq_bytes
from pdserve.runtime.kv_events import BlockStored, decode_batch
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pdserve.runtime.metrics import BATCH_BUCKETS, E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, parse_samples
from tests.support.server import free_port, launch_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
LABEL = f'{{model_name="{MODEL}"}}'


@pytest.fixture(scope="module")
def server():
    events_port, replay_port = free_port(), free_port()
    with launch_server("--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks", "400", "--max-num-seqs", "64",
                       "--kv-events-port", str(events_port), "--kv-events-replay-port", str(replay_port),
                       "--kv-events-host", "127.0.0.1") as handle:
        handle.events_port, handle.replay_port = events_port, replay_port
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def metrics(server) -> dict[str, float]:
    return parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m[f"vllm:num_requests_running{LABEL}"] == 0 and m[f"vllm:num_requests_waiting{LABEL}"] == 0
                and m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0):
            return m
        assert time.monotonic() < deadline, f"server never went idle: {m}"
        time.sleep(0.2)


# ---- OpenAI client ----

def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of "
                                                               "France?"}], max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_with_logprobs_and_length_finish(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)


def test_chat_stream_with_usage_matches_non_stream(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks)
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text == full.choices[0].text


def test_n_choices(client):
    r = client.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=4, n=3, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, n=2, stream=True, temperature=1.0,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    finishes = sorted((c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                      if c.choices and c.choices[0].finish_reason)
    assert finishes == [(0, "length"), (1, "length")] and chunks[-1].usage.completion_tokens == 6


def test_sse_wire_format_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_request_id_header_and_extensions(server):
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "my-req-1"}, timeout=60,
                   json={"prompt": [1, 2, 3, 4], "max_tokens": 2, "priority": 1, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-request-id"] == "my-req-1" and body["id"] == "cmpl-my-req-1"
    # no P/D handoff was asked for (no kv_transfer_params sent): none is offered
    assert body["kv_transfer_params"] is None and body["usage"]["prompt_tokens"] == 4


def test_cache_salt_isolates_prefix_cache_hits(server):
    """Same salt: the second request reuses the prompt's 2 full blocks; another salt, or none, shares nothing."""
    prompt = list(range(4000, 4040))                     # 2 full blocks of 16 + 8, unique to this test

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt is not None else {})}
        r = httpx.post(server.url + COMPL, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(s) for s in ("tenant-a", "tenant-a", "tenant-b", None, "tenant-b", None, "tenant-a")] == [
        0, 32, 0, 0, 32, 32, 32]


def test_tokenize_detokenize_version_health(server):
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert detok["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10)
    assert chat.json()["count"] > 3
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- errors (raw HTTP) ----

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path,body,param", [
    (COMPL, {"max_tokens": 2}, "prompt"),                                         # missing field
    (CHAT, {"model": MODEL}, "messages"),                                         # missing field
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None),
    (COMPL, {"model": "gpt-17", "prompt": "x"}, "model"),                          # unknown model
    (COMPL, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),           # beyond max-model-len
    (CHAT, {"messages": MSGS, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (COMPL, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": -3}, None),
    (COMPL, {"prompt": "x", "temperature": -0.5}, "temperature"),
    (COMPL, {"prompt": "x", "top_p": 0}, "top_p"),
    (CHAT, {"messages": MSGS, "top_p": 1.5}, "top_p"),
    (COMPL, {"prompt": "x", "n": 17}, "n"),
    (COMPL, {"prompt": "x", "n": 0}, "n"),
    (COMPL, {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    (COMPL, {"prompt": [99999999]}, "prompt"),                                    # token id outside the vocab
    (COMPL, {"prompt": ""}, "prompt"),
    (COMPL, {"prompt": "x", "logprobs": 50}, "logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, None),                          # needs logprobs=true
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_request_is_400(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_400(server, content):
    r = httpx.post(server.url + COMPL, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + COMPL, timeout=10)
    assert r.status_code == 405 and "error" in r.json()


# ---- disconnects free blocks ----

def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = wait_idle(server)
    aborted_key = f"pdserve:requests_aborted_on_disconnect_total{LABEL}"
    with httpx.stream("POST", server.url + COMPL, timeout=60, json={
            "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        m = metrics(server)
        assert m[f"vllm:kv_cache_usage_perc{LABEL}"] > 0 and m[f"vllm:num_requests_running{LABEL}"] == 1
    after = wait_idle(server)   # blocks back long before 400 tokens could have been generated
    assert after[aborted_key] == before[aborted_key] + 1
    assert after[f"vllm:generation_tokens_total{LABEL}"] - before[f"vllm:generation_tokens_total{LABEL}"] < 400


def test_non_stream_disconnect_aborts(server):
    before = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + COMPL, timeout=httpx.Timeout(30, read=1.5), json={
            "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True})
    after = wait_idle(server)
    assert after[f"vllm:generation_tokens_total{LABEL}"] - before[f"vllm:generation_tokens_total{LABEL}"] < 400


# ---- metrics ----

# Every metric family /metrics exposes (tracing off, no KV connector), with its type: vLLM's names, then pdserve's.
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "pdserve:kv_load_failures": "counter", "pdserve:recomputed_tokens": "counter", "pdserve:batch_size": "histogram",
    "pdserve:max_batch_size": "gauge", "pdserve:engine_steps": "counter", "pdserve:requests_rejected": "counter",
    "pdserve:requests_aborted_on_disconnect": "counter", "pdserve:kv_event_batches_published": "counter",
    "pdserve:model_weight_bytes": "gauge",
    "pdserve:grammar_compile_seconds": "histogram", "pdserve:grammar_cache_hits": "counter",
    "pdserve:grammar_cache_misses": "counter", "pdserve:structured_output_requests": "counter",
}
EXTRA_LABELS = {"vllm:request_success": {"finished_reason"}, "pdserve:requests_rejected": {"reason"},
                "pdserve:structured_output_requests": {"kind"}}
BUCKETS = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS, "vllm:inter_token_latency_seconds": ITL_BUCKETS,
           "vllm:e2e_request_latency_seconds": E2E_BUCKETS, "pdserve:batch_size": BATCH_BUCKETS}


def scrape(server) -> tuple[dict[str, Metric], dict[tuple[str, frozenset], float]]:
    """/metrics through prometheus_client's own parser: families by name (client_python's `_created` companions
    left out) and every sample by (name, labels)."""
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text)
            if not f.name.endswith("_created")}
    return fams, {(s.name, frozenset(s.labels.items())): s.value for f in fams.values() for s in f.samples}


def test_metrics_exposition(server, client):
    wait_idle(server)
    fams, before = scrape(server)
    assert {name: f.type for name, f in fams.items()} == FAMILIES
    for name, f in fams.items():
        for s in f.samples:
            assert s.labels["model_name"] == MODEL and set(s.labels) - {"model_name"} == (
                {"le"} if s.name.endswith("_bucket") else EXTRA_LABELS.get(name, set())), s
        if name in BUCKETS:   # vLLM's buckets, so that dashboards' quantile queries behave the same
            assert [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")] == [
                *(str(float(b)) for b in BUCKETS[name]), "+Inf"]
    assert {s.labels["reason"] for s in fams["pdserve:requests_rejected"].samples} == {"queue_full", "draining"}

    # Traffic: the same 40-token prompt (2 full blocks of 16 + 8) twice, 3 tokens each, one after the other.
    prompt = list(range(3000, 3040))
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True}).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 32]
    wait_idle(server)
    _, after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset({"model_name": MODEL, **labels}.items()))
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == 40 + 8                  # the second prefill computes 8, reuses 32
    assert (delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")) == (80, 32)
    assert delta("vllm:generation_tokens_total") == 6
    success = {dict(k[1])["finished_reason"]: after[k] - before.get(k, 0.0) for k in after
               if k[0] == "vllm:request_success_total"}
    assert {reason: d for reason, d in success.items() if d} == {"length": 2}   # and no other reason moved
    for hist, count in (("vllm:e2e_request_latency_seconds", 2), ("vllm:time_to_first_token_seconds", 2),
                        ("vllm:inter_token_latency_seconds", 4)):       # per request: 1 TTFT, 2 gaps, 1 end
        assert delta(f"{hist}_count") == count and delta(f"{hist}_bucket", le="+Inf") == count, hist
        assert delta(f"{hist}_sum") > 0, hist
    # one request at a time: prefill + 2 decode steps each, one request per step
    assert delta("pdserve:engine_steps_total") == delta("pdserve:batch_size_count") == 6
    assert delta("pdserve:batch_size_sum") == 6 and delta("pdserve:batch_size_bucket", le="1.0") == 6
    for name in ("vllm:num_preemptions_total", "pdserve:kv_load_failures_total", "pdserve:recomputed_tokens_total",
                 "pdserve:requests_aborted_on_disconnect_total"):
        assert delta(name) == 0, name
    for reason in ("queue_full", "draining"):
        assert delta("pdserve:requests_rejected_total", reason=reason) == 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[(gauge, frozenset({"model_name": MODEL}.items()))] == 0, gauge
    # SmolLM2-135M at the auto dtype (tied embedding counted once): ~134.5M parameters x 4 (float32) or 2 (bf16) bytes;
    # float32 on a CPU without AVX-512 also holds the GGUF codes its 1-8 row steps run on (kernels/gguf_codes_linear.py):
    # the decoder's Q4_1 (~80 MB) and the embedding's Q8_0 (~32 MB)
    import torch

    from pdserve.kernels import gguf_codes_linear
    from pdserve.runtime.cpu_features import fast_bf16_flag

    width = 2 if fast_bf16_flag() else 4
    codes = (105e6, 120e6) if width == 4 and gguf_codes_linear.applies(torch.device("cpu"), torch.float32) else (0, 0)
    assert 125e6 * width + codes[0] < after[("pdserve:model_weight_bytes", frozenset({"model_name": MODEL}.items()))] \
        < 140e6 * width + codes[1]


# ---- KV events over ZMQ ----

def test_kv_events_published_and_replayed(server, client):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{server.events_port}")
    time.sleep(0.5)  # PUB drops messages until the subscription has propagated
    prompt = "A unique prompt for the KV event test: " + "alpha beta gamma delta " * 6
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False},
                            timeout=10).json()["tokens"]
    assert len(prompt_ids) >= 32
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    stored: list[BlockStored] = []
    seqs = []
    deadline = time.monotonic() + 20
    while not any(e.token_ids[:16] == prompt_ids[:16] for e in stored):
        assert time.monotonic() < deadline, "no BlockStored event for the prompt's first block"
        if sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
    first = next(e for e in stored if e.token_ids[:16] == prompt_ids[:16])
    assert first.block_size == 16 and first.parent_block_hash is None
    assert len(first.token_ids) == 16 * len(first.block_hashes)
    assert all(len(h) == 32 for h in first.block_hashes)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))   # consecutive: no gaps

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{server.replay_port}")
    dealer.send_multipart([b"", seq_bytes(seqs[0])])
    replayed = []
    while True:
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        replayed.append(int.from_bytes(seq, "big"))
    assert replayed[:len(seqs)] == seqs
    sub.close()
    dealer.close()
    ctx.term()


# ---- load: 64 concurrent streaming clients ----

def test_64_concurrent_streams_are_batched(server):
    n = 64

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say a word about the number {i}."}], max_tokens=8,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=240,
                                      max_retries=0, http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=n))) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(n))), 280)

    results = asyncio.run(run())
    assert len(results) == n and all(tokens == 8 and text for text, tokens in results)
    m = metrics(server)
    assert m[f"pdserve:max_batch_size{LABEL}"] > 1
    # batching: far fewer engine steps than the 64 * 8 tokens generated one request at a time would need
    assert m[f"pdserve:batch_size_sum{LABEL}"] / m[f"pdserve:batch_size_count{LABEL}"] > 1
    wait_idle(server)
