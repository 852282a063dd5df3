"""The one validation path (runtime/validation.py): ranges that reach torch, model limits, request ids; and the
protocol layer reporting each failure as a 400 that names the client's field."""

from __future__ import annotations

import pytest

from pdserve.runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.validation import (InvalidParam, RequestLimits, check_logit_bias, check_request,
                                        check_request_id)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=128, block_size=16, num_blocks=64)
MSGS = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("kw,param", [
    (dict(seed=2**64), "seed"), (dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(n=2, seed=2**64 - 1), "seed"), (dict(n=2, seed=2**63 - 1), "seed"), (dict(seed=1.5), "seed"),
    (dict(top_k=2**63), "top_k"), (dict(top_k=2**31), "top_k"), (dict(top_k=True), "top_k"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=10**400), "temperature"), (dict(top_p=float("nan")), "top_p"), (dict(min_p=-0.0001), "min_p"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"), (dict(repetition_penalty=11), "repetition_penalty"),
    (dict(n=17), "n"), (dict(n=True), "n"), (dict(logprobs=-1), "logprobs"), (dict(max_tokens=1.0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(stop=["a"] * 17), "stop"), (dict(stop_token_ids=["1"]), "stop_token_ids"),
])
def test_sampling_params_ranges(kw, param):
    with pytest.raises(InvalidParam, match=param) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_sampling_params_edges_accepted():
    SamplingParams(n=16, seed=2**63 - 16, top_k=2**31 - 1, temperature=100, min_p=1, logprobs=20)
    SamplingParams(seed=-(2**63), stop_token_ids=[0])
    assert SamplingParams(temperature=1e-9).greedy and not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("prompt,kw,priority,param", [
    ([1, 2], dict(stop_token_ids=[1000], min_tokens=1), 0, "stop_token_ids"),
    ([1, 1000], {}, 0, "prompt"), ([1, -1], {}, 0, "prompt"), ([], {}, 0, "prompt"),
    (list(range(128)), dict(max_tokens=None), 0, "prompt"),
    (list(range(100)), dict(max_tokens=29), 0, "max_tokens"),
    ([1], {}, 2**63, "priority"), ([1], {}, -(2**63) - 1, "priority"),
])
def test_check_request_refuses(prompt, kw, priority, param):
    with pytest.raises(InvalidParam) as e:
        check_request(prompt, SamplingParams(**kw), LIMITS, priority=priority)
    assert e.value.param == param


def test_check_request_resolves_max_tokens():
    assert check_request(list(range(100)), SamplingParams(max_tokens=None), LIMITS) == 28
    assert check_request([1], SamplingParams(max_tokens=5, stop_token_ids=[999]), LIMITS, priority=-5) == 5
    small = RequestLimits(vocab_size=1000, max_model_len=128, block_size=16, num_blocks=2)
    with pytest.raises(InvalidParam, match="KV blocks"):
        check_request([1] * 20, SamplingParams(max_tokens=20), small)


@pytest.mark.parametrize("rid", ["x\r\ny", "x\ny", "日本", "é", "a#0", "a b", "", "a" * 257, None, 5])
def test_unsafe_request_ids(rid):
    with pytest.raises(InvalidParam):
        check_request_id(rid)


@pytest.mark.parametrize("rid", ["req-1", "a" * 256, "0f9c2b8e-uuid_4.2:trace/x=1", "x~y@z"])
def test_safe_request_ids(rid):
    assert check_request_id(rid) == rid


def test_logit_bias_checks():
    check_logit_bias({"5": 100, "7": -100.0}, vocab_size=10)
    for bias in ({"x": 1}, {"-1": 1}, {"10": 1}, {"5": 101}, {"5": float("nan")}, {"9" * 30: 1}):
        with pytest.raises(InvalidParam, match="logit_bias"):
            check_logit_bias(bias, vocab_size=10)


@pytest.mark.parametrize("model,body,param", [
    (CompletionRequest, {"prompt": "x", "seed": 2**64}, "seed"),
    (CompletionRequest, {"prompt": "x", "n": 2, "seed": 2**64 - 1}, "seed"),
    (CompletionRequest, {"prompt": "x", "top_k": 2**63}, "top_k"),
    (CompletionRequest, {"prompt": "x", "priority": 2**63}, "priority"),
    (CompletionRequest, {"prompt": "x", "request_id": "x\r\ny"}, "request_id"),
    (CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": 1}}, "logit_bias"),
    (CompletionRequest, {"prompt": "x", "min_tokens": 20}, "min_tokens"),        # > max_tokens (16 by default)
    (ChatCompletionRequest, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (ChatCompletionRequest, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (ChatCompletionRequest, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
])
def test_parse_names_the_clients_field(model, body, param):
    with pytest.raises(ApiError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param), e.value.message
