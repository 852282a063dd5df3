"""Fuzzing one real `pdserve serve` (default model, CPU) with hostile OpenAI request bodies.

Bodies come from tests/support/openai_strategies.py (shared with the router's fuzz test). Every answer must be a
2xx or an OpenAI-shaped 4xx (never a 5xx or a dropped connection), no stream may carry an error event, and /health must
stay 200 after every example: no body may kill the engine. Bounded: ``PDSERVE_FUZZ_EXAMPLES`` examples per endpoint
(default 100), at most ``MAX_TOKENS`` tokens per accepted request, a 60 s limit per request.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.openai_strategies import (RAW_BODIES, assert_openai_error, chat_bodies, completion_bodies, encode,
                                            numeric_edges, structured_bodies)
from tests.support.server import launch_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def server():
    with launch_server("--max-model-len", "256", "--num-gpu-blocks", "256", "--max-num-seqs", "16") as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def check(server, http: httpx.Client, path: str, content: bytes) -> int:
    try:
        r = http.post(path, content=content, headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        raise AssertionError(f"no answer ({e!r}) to {content[:300]!r}\n{server.logs(tail=3000)}") from None
    assert r.status_code < 500, f"{r.status_code} {r.text[:300]} for {content[:300]!r}\n{server.logs(tail=3000)}"
    if r.status_code >= 300:
        assert_openai_error(r.status_code, r.content)
    elif r.headers["content-type"].startswith("text/event-stream"):
        # SSE lines end at CR/LF only: str.splitlines would also cut at U+2028, U+0085... that JSON leaves raw
        events = [line[6:] for line in re.split(r"\r\n|\r|\n", r.text) if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-300:]
        for data in events[:-1]:
            # the one error event a well-behaved server may send mid-stream is the client's own (a 4xx class, like
            # the status rule above): a constraint that reached a state no token of the vocabulary continues
            err = json.loads(data).get("error")
            assert err is None or err.get("code") == "structured_output_dead_end", \
                f"error event {data} for {content[:300]!r}"
    else:
        assert r.json()["choices"], r.text[:300]
    health = http.get("/health")
    assert health.status_code == 200, f"engine died on {content[:300]!r}: {health.text}\n{server.logs(tail=3000)}"
    return r.status_code


@FUZZ
@given(body=completion_bodies(MODEL))
def test_fuzz_completions(server, http, body):
    event(f"HTTP {check(server, http, '/v1/completions', encode(body))}")   # --hypothesis-show-statistics


@FUZZ
@given(body=chat_bodies(MODEL))
def test_fuzz_chat_completions(server, http, body):
    event(f"HTTP {check(server, http, '/v1/chat/completions', encode(body))}")


@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(chat=st.booleans(), data=st.data())
def test_fuzz_structured_outputs_and_tools(server, http, chat, data):
    """response_format / structured_outputs / tools + tool_choice shapes on otherwise well-formed bodies: they reach
    the grammar compiler (schemas, regexes and grammars that compile or not) and are served or refused, never a 5xx."""
    body = data.draw(structured_bodies(MODEL, chat), label="body")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    event(f"{'chat' if chat else 'completions'} HTTP {check(server, http, path, encode(body))}")


def test_streamed_unicode_line_separators(server, http):
    """Output holding U+2028 / U+0085 (raw in the SSE JSON, which escapes only what JSON must) streams intact."""
    for path, ask in (("/v1/completions", {"prompt": "hi"}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {**ask, "max_tokens": 4, "stream": True, "structured_outputs": {"regex": "a\u2028b\u0085c"}}
        assert check(server, http, path, encode(body)) == 200


@pytest.mark.parametrize("content", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_bodies(server, http, path, content):
    check(server, http, path, content)


def test_every_numeric_field_at_every_edge(server, http):
    """Deterministic sweep (random draws rarely hit a given edge): each numeric field at each int64/uint64/float edge,
    on a sampling request with n=2 (child seeds are seed + i) and min_tokens=1 (stop token ids get masked)."""
    base = {"prompt": "Hello", "max_tokens": 1, "n": 2, "temperature": 1.0, "min_tokens": 1, "top_k": 50}
    for key, value in numeric_edges():
        check(server, http, "/v1/completions", encode({**base, key: value}))
