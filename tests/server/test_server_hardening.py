"""One hostile request must never hurt the server: the engine killers of issue 20 (each once, against a real
`pdserve serve`), deeply nested JSON, header-breaking request ids, and a prompt big enough to tokenize for seconds
while /health keeps answering."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.openai_strategies import assert_openai_error
from tests.support.server import launch_server

pytestmark = pytest.mark.slow

COMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]
VOCAB = 49152   # SmolLM2's


@pytest.fixture(scope="module")
def server():
    with launch_server("--max-model-len", "512", "--num-gpu-blocks", "256") as handle:
        yield handle


def assert_alive(server) -> None:
    """/health is 200 and a normal request still completes."""
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200, server.logs(tail=3000)
    r = httpx.post(server.url + COMPL, timeout=60, json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


# The four requests that each left /health at "engine dead" until a restart (issue 20, section 3), and relatives.
@pytest.mark.parametrize("path,body,param", [
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "seed": 2**64}, "seed"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "seed": -(2**63) - 1}, "seed"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "n": 2, "seed": 2**64 - 1}, "seed"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "n": 2, "seed": 2**63 - 1}, "seed"),            # child seed + 1
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 2**63}, "top_k"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "temperature": 1, "top_k": 2**63}, "top_k"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [VOCAB + 5], "min_tokens": 1}, "stop_token_ids"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "stop_token_ids": [2**40], "min_tokens": 1}, "stop_token_ids"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "priority": 2**64}, "priority"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "temperature": 1e308, "min_p": 0.5}, "temperature"),
    (CHAT, {"messages": MSGS, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"50000000": 5}}, "logit_bias"),
    (COMPL, {"prompt": "Hi", "max_tokens": 2, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_engine_killers_are_400_and_engine_lives(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert_openai_error(r.status_code, r.content)
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert_alive(server)


def test_seeded_n_and_truncation_still_work(server):
    r = httpx.post(server.url + COMPL, timeout=60, json={"prompt": "Once upon a time", "max_tokens": 3, "n": 2,
                                                           "seed": 2**63 - 2, "temperature": 1, "top_k": 2**31 - 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = httpx.post(server.url + COMPL, timeout=60, json={"prompt": list(range(100, 700)), "max_tokens": 2,
                                                           "truncate_prompt_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100, r.text


@pytest.mark.parametrize("content", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"a": ' + b"[" * 900 + b"]" * 900 + b"}}",
    b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
    b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi \\ud800", "max_tokens": 1}',
], ids=["deep-array", "deep-kv-params", "nan", "5000-digits", "lone-surrogate"])
def test_malformed_json_is_400(server, content):
    r = httpx.post(server.url + COMPL, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert_openai_error(r.status_code, r.content)
    assert_alive(server)


@pytest.mark.parametrize("request_id", ["x\r\ny", "x\ny", "日本", "é", "a#0", "a" * 257, ""])
def test_unsafe_request_ids_are_400(server, request_id):
    r = httpx.post(server.url + COMPL, json={"prompt": "Hi", "max_tokens": 1, "request_id": request_id}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "request_id"
    assert_alive(server)


def test_unsafe_request_id_header_is_400(server):
    r = httpx.post(server.url + COMPL, json={"prompt": "Hi", "max_tokens": 1}, timeout=60,
                   headers={"X-Request-Id": "caf\xe9".encode("latin-1")})   # legal HTTP, not a safe id
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    r = httpx.post(server.url + COMPL, json={"prompt": "Hi", "max_tokens": 1}, timeout=60,
                   headers={"X-Request-Id": "trace-1:2/3"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-1:2/3"


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """A multi-megabyte prompt is tokenized off the event loop: /health keeps answering meanwhile. Relative check:
    the slowest health answer took a small part of the big request's time (tokenizing on the loop made one health
    answer wait for nearly all of it)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 40_000   # 1.8 MB: seconds of tokenizing
    result: dict = {}

    def big() -> None:
        start = time.monotonic()
        result["response"] = httpx.post(server.url + COMPL, json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=big)
    latencies = []
    with httpx.Client(timeout=300) as client:
        thread.start()
        while thread.is_alive():
            t0 = time.monotonic()
            assert client.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    thread.join()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text   # far beyond the context
    assert len(latencies) >= 5, (latencies, result["seconds"])
    assert max(latencies) < result["seconds"] / 3, (max(latencies), result["seconds"])
    assert_alive(server)
