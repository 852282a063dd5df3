"""Request mapping (runtime/request_mapping.py) against the real engine and app, in process: the server checks a
request as the engine will and hands the engine what the client asked, so the two never disagree.

The engine here has a KV pool (8 blocks of 16 tokens) smaller than its context (512 tokens): an open-ended request
(no ``max_tokens``) runs until the pool is full and ends with ``length``; an explicit ``max_tokens`` that cannot fit
is a 400 naming the field, before the engine sees it.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.routes import build_app

POOL_TOKENS = 8 * 16


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine(EngineConfig.from_options(num_gpu_blocks=8, max_model_len=512, device="cpu"))
    try:
        with TestClient(build_app(engine)) as c:
            yield c
    finally:
        engine.shutdown()


def test_the_engine_is_what_the_server_expects(client):
    assert isinstance(client.app.state.pdserve.engine, EngineClient)   # every member of the seam exists
    assert not isinstance(object(), EngineClient)


def test_open_ended_request_runs_until_the_pool_is_full(client):
    r = client.post("/v1/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": None, "ignore_eos": True,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert POOL_TOKENS - 16 < body["usage"]["total_tokens"] <= POOL_TOKENS   # cut by the pool, not by the context


def test_open_ended_chat_is_not_refused(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": None,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_explicit_max_tokens_beyond_the_pool_is_400(client):
    r = client.post("/v1/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": POOL_TOKENS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "KV blocks" in err["message"]


@pytest.mark.parametrize("prompt", ["", [], [""]])
def test_empty_prompt_is_400_naming_prompt(client, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "empty" in r.json()["error"]["message"]
