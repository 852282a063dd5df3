"""`pdserve serve --speculative-config` end to end: the official openai client gets the same greedy completion as the
offline engine without speculation, and /metrics carries vLLM's spec-decode counters, consistent with each other."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve.runtime import LLM, SamplingParams
from pdserve.runtime.metrics import parse_samples
from tests.support.server import launch_server

pytestmark = pytest.mark.slow

PROMPT = "Shopping list: apples, bananas, carrots, dates, eggs. Shopping list again: apples, bananas,"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_served_greedy_equals_plain_and_metrics():
    plain = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64)
    want = plain.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    plain.shutdown()
    with launch_server("--dtype", "float32", "--num-gpu-blocks", "64", "--max-model-len", "512",
                       "--speculative-config", json.dumps(SPEC)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
        got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        m = parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)
    label = '{model_name="SmolLM2-135M-Instruct"}'
    drafts, tokens = m[f"vllm:spec_decode_num_drafts_total{label}"], m[f"vllm:spec_decode_num_draft_tokens_total{label}"]
    accepted = m[f"vllm:spec_decode_num_accepted_tokens_total{label}"]
    per_pos = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert drafts > 0 and 0 < accepted <= tokens and sum(per_pos) == accepted
    # max_tokens holds: accepted runs never overshoot it
    assert m[f"vllm:generation_tokens_total{label}"] == 16
