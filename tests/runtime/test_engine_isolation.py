"""One request's failure stays that request's, on the real default model: the issue 20 killers are refused by the
offline path too, a request whose step raises (fault injected into the sampler: the one test double here) fails alone
while the others finish, and aborting an ``n > 1`` request leaves no fan-out state behind."""

from __future__ import annotations

import pytest

from pdserve.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks=64)
    yield llm
    llm.shutdown()


def run(engine, ids: set[str]) -> dict:
    done = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if ids <= done.keys() and not engine.has_unfinished_requests():
            return done
    raise AssertionError(f"unfinished: {ids - done.keys()}")


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=1.0, seed=2**64), "seed"),
    (dict(temperature=1.0, n=2, seed=2**64 - 1), "seed"),
    (dict(temperature=1.0, n=2, seed=2**63 - 1), "seed"),
    (dict(temperature=1.0, top_k=2**63), "top_k"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_offline_killers_are_refused(kw, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(max_tokens=2, **kw)


def test_out_of_vocab_stop_token_is_refused_and_engine_keeps_working(llm):
    vocab = llm.engine.hf_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("Hi", SamplingParams(max_tokens=2, stop_token_ids=[vocab], min_tokens=1))
    with pytest.raises(ValueError, match="priority"):
        llm.engine.add_request("p", "Hi", SamplingParams(max_tokens=2), priority=2**63)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hi", SamplingParams(max_tokens=2, temperature=1.0, seed=2**63 - 1, top_k=2**31 - 1))
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_request_failing_inside_a_step_fails_alone(llm, monkeypatch):
    engine = llm.engine
    real = engine.runner.sample

    def sample(fwd):   # fault injection: sampling raises whenever request "bad" is in the batch (greedy head or not)
        if fwd is not None and "bad" in fwd.req_ids:
            raise RuntimeError("injected sampler fault")
        return real(fwd)

    monkeypatch.setattr(engine.runner, "sample", sample)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate("The capital of France is", greedy)[0].outputs[0].token_ids
    for rid in ("good1", "bad", "good2"):
        engine.add_request(rid, "The capital of France is", greedy)
    done = run(engine, {"good1", "bad", "good2"})
    assert done["bad"].outputs[0].finish_reason == "error" and "injected sampler fault" in done["bad"].error
    for rid in ("good1", "good2"):   # same tokens as alone: the retried step is exact
        assert done[rid].outputs[0].finish_reason == "length" and done[rid].outputs[0].token_ids == expected
    assert engine.get_stats().kv_cache_usage == 0.0 and not engine._requests
    assert llm.generate("The capital of France is", greedy)[0].outputs[0].token_ids == expected


def test_a_failing_postprocess_fails_alone(llm, monkeypatch):
    engine = llm.engine
    real = engine.outputs._output

    def postprocess(req):
        if req.request_id == "bad":
            raise UnicodeError("injected detokenizer fault")
        return real(req)

    monkeypatch.setattr(engine.outputs, "_output", postprocess)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("bad", "Hello", greedy)
    engine.add_request("good", "Hello", greedy)
    done = run(engine, {"bad", "good"})
    assert done["bad"].outputs[0].finish_reason == "error" and "injected" in done["bad"].error
    assert done["good"].outputs[0].finish_reason in ("length", "stop")
    assert engine.get_stats().kv_cache_usage == 0.0 and not engine._requests


def test_aborting_an_n_request_leaves_no_fanout_state(llm):
    engine = llm.engine
    engine.add_request("fan", "Tell me a story", SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=1))
    engine.step()
    engine.abort_request("fan")
    assert not engine._fan_out._parents and not engine._fan_out._child_of and not engine._requests and not engine._detok
    assert not engine.has_unfinished_requests() and engine.get_stats().kv_cache_usage == 0.0
    engine.add_request("fan", "Tell me a story", SamplingParams(n=2, max_tokens=2))   # the id is free again
    assert len(run(engine, {"fan"})["fan"].outputs) == 2
    assert not engine._fan_out._child_of
