"""Grammar-constrained decoding inside the engine (real default model, CPU, one engine for the module): faithfulness to
the unconstrained greedy choice, a compiling grammar that holds up no one, constrained and free rows in one step,
preemption-recompute, matcher rollback on both backends, the automatic backend choice."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.structured_output.manager import StructuredOutputManager
from pdserve.runtime.structured_output.params import StructuredOutputsParams as SO

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=128)
    yield llm
    llm.shutdown()


def prompt(llm, text: str) -> list[int]:
    return llm.engine.apply_chat_template([{"role": "user", "content": text}])


def run(llm, reqs: dict[str, tuple[list[int], SamplingParams]], on_step=None) -> dict[str, list[int]]:
    eng = llm.engine
    for rid, (ids, sp) in reqs.items():
        eng.add_request(rid, ids, sp)
    done: dict[str, list[int]] = {}
    while len(done) < len(reqs):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if on_step:
            on_step(eng)
    return done


@pytest.fixture
def spy(monkeypatch):
    """Records, for every step with a grammar, the rows, their unmasked argmax and the bitmask the sampler applies
    (the real sampler runs)."""
    steps: list[tuple[list[str], list[int], torch.Tensor, list[int]]] = []
    original = Sampler.__call__

    def call(self, logits, meta):
        if meta.grammar_bitmask is not None:
            steps.append((list(meta.req_ids), logits.argmax(-1).tolist(), meta.grammar_bitmask.clone(),
                          list(meta.grammar_rows)))
        return original(self, logits, meta)

    monkeypatch.setattr(Sampler, "__call__", call)
    return steps


def allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def test_constrained_greedy_keeps_every_allowed_unconstrained_choice(llm, spy):
    """At every step the constrained greedy token is the unconstrained argmax whenever the grammar allows it; the
    run equals the unconstrained greedy run up to the first step where the grammar refuses that argmax."""
    ids = prompt(llm, "Who are you? Answer in JSON.")
    free = run(llm, {"free": (ids, SamplingParams(max_tokens=24, temperature=0))})["free"]
    assert not spy   # no grammar, no mask
    out = run(llm, {"c": (ids, SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(json=SCHEMA)))})["c"]
    jsonschema.validate(json.loads(llm.tokenizer.decode(out, skip_special_tokens=True)), SCHEMA)
    assert len(spy) == len(out)
    parted = None
    for i, ((rids, argmax, bitmask, rows), token) in enumerate(zip(spy, out)):
        assert rows == [0]
        if allowed(bitmask[0], argmax[0]):
            assert token == argmax[0], f"step {i}: the grammar allowed {argmax[0]} but {token} was picked"
        else:
            assert token != argmax[0]
            parted = i if parted is None else parted
    assert parted is not None, "the grammar never had to step in"
    assert out[:parted] == free[:parted] and out[parted] != free[parted]


def test_compiling_grammar_holds_up_no_one(llm, monkeypatch):
    """A request whose grammar is still compiling waits; a plain request added after it runs to the end meanwhile."""
    eng = llm.engine
    gate = threading.Event()
    compile_ = eng.structured._compile
    monkeypatch.setattr(eng.structured, "_compile", lambda *a: (gate.wait(60), compile_(*a))[1])
    schema = {**SCHEMA, "title": "not cached yet"}
    ids = prompt(llm, "Name and age?")
    eng.add_request("slow", ids, SamplingParams(max_tokens=40, temperature=0,
                                                structured_outputs=SO(json=schema, disable_any_whitespace=True)))
    eng.add_request("quick", ids, SamplingParams(max_tokens=4, temperature=0))
    outs = {}
    while "quick" not in outs:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert "slow" not in outs and [r.request_id for r in eng._grammar._waiting] == ["slow"]
    assert eng._requests["slow"].num_computed_tokens == 0
    gate.set()
    while "slow" not in outs:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    jsonschema.validate(json.loads(outs["slow"].outputs[0].text), schema)


def test_constrained_and_free_rows_share_steps(llm, spy):
    """A schema row, a regex row and a free row in the same steps: one bitmask per step, masking only the
    constrained rows; the free row's output is token for token the one it has alone."""
    ids = prompt(llm, "Tell me about cats.")
    alone = run(llm, {"alone": (ids, SamplingParams(max_tokens=12, temperature=0))})["alone"]
    spy.clear()
    compact, rx = SO(json=SCHEMA, disable_any_whitespace=True), SO(regex=r"[a-z]{1,8} [0-9]{2}")
    for params in (compact, rx):   # compiled beforehand, so all three rows start in the same step
        llm.engine.structured.validate(params)
    outs = run(llm, {"json": (ids, SamplingParams(max_tokens=40, temperature=0, structured_outputs=compact)),
                     "rx": (ids, SamplingParams(max_tokens=12, temperature=0, structured_outputs=rx)),
                     "free": (ids, SamplingParams(max_tokens=12, temperature=0))})
    assert outs["free"] == alone
    assert re.fullmatch(r"[a-z]{1,8} [0-9]{2}", llm.tokenizer.decode(outs["rx"], skip_special_tokens=True))
    jsonschema.validate(json.loads(llm.tokenizer.decode(outs["json"], skip_special_tokens=True)), SCHEMA)
    rids, _, bitmask, rows = spy[0]
    assert sorted(rids) == ["free", "json", "rx"] and sorted(rids[i] for i in rows) == ["json", "rx"]
    assert bool((bitmask[rids.index("free")] == -1).all())


def test_preemption_recompute_does_not_advance_the_matcher_twice(llm):
    ids = prompt(llm, "Name and age?")
    sp = SamplingParams(max_tokens=40, temperature=0, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    plain = run(llm, {"p": (ids, sp)})["p"]
    state = {"steps": 0}

    def preempt(eng):
        state["steps"] += 1
        req = eng._requests.get("q")
        if state["steps"] == 4 and req is not None and req in eng.scheduler.running:
            eng.scheduler._preempt(req)   # recompute from scratch; the output tokens stay
            state["preempted"] = True

    assert run(llm, {"q": (ids, sp)}, preempt)["q"] == plain and state.get("preempted")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_matcher_rollback_and_resync(llm, backend):
    m = StructuredOutputManager(llm.tokenizer, int(llm.engine.hf_config.vocab_size), [llm.engine.eos_token_id],
                                backend=backend)
    try:
        obj = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                 disable_any_whitespace=True)
        assert m.validate(obj) == backend and m.validate(SO(regex="x")) == backend
        m.add_request("r", obj)
        assert m.ready("r")   # compiled above: a cache hit
        good = llm.tokenizer.encode('{"a": 12}', add_special_tokens=False)
        bad = llm.tokenizer.encode('{"a": "x"}', add_special_tokens=False)
        assert m.accept("r", good[:3])
        assert m.accept("r", good[:3])                     # the same tokens again (a recompute): no double advance
        assert m.accept("r", good[:2]) and m.accept("r", good)   # rolled back one, then forward again
        assert m.accept("r", good + [llm.engine.eos_token_id]) and m._requests["r"].matcher.is_terminated()
        m.add_request("s", obj)
        assert m.ready("s") and m.stats.cache_hits >= 2
        assert not m.accept("s", bad)
    finally:
        m.shutdown()


def test_auto_backend_choice_and_forced_backend(llm):
    """allOf is compiled but not enforced by xgrammar: auto sends it to llguidance, which enforces it."""
    s = llm.engine.structured
    all_of = {"allOf": [{"type": "integer"}, {"minimum": 500, "maximum": 510}]}
    assert s.validate(SO(json=all_of)) == "llguidance"
    assert s.validate(SO(json=SCHEMA)) == "xgrammar"
    assert s.validate(SO(grammar='start: "a" | "b"')) == "llguidance"   # Lark: xgrammar cannot read it
    out = run(llm, {"n": (prompt(llm, "Pick a number."),
                          SamplingParams(max_tokens=8, temperature=0, structured_outputs=SO(json=all_of)))})["n"]
    assert 500 <= int(llm.tokenizer.decode(out, skip_special_tokens=True)) <= 510
    cfg = EngineConfig.from_options(structured_outputs_backend="llguidance")
    assert cfg.structured_outputs.backend == "llguidance"
    with pytest.raises(ValueError):
        StructuredOutputManager(llm.tokenizer, 10, [0], backend="outlines")


def test_pd_decode_enforces_the_grammar_from_its_first_token(llm, tmp_path):
    """Prefill (1 token, discarded) -> disk KV -> decode: the decode pod's matcher starts at its own first token, and
    its output equals the monolithic constrained run while the prompt's KV comes from the prefill pod."""
    ids = prompt(llm, "Name and age?")
    sp = SamplingParams(max_tokens=30, temperature=0,
                        structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    expected = run(llm, {"mono": (ids, sp)})["mono"]
    cfg = {"path": str(tmp_path)}
    prefill = LLM(dtype="float32", num_gpu_blocks=64, kv_connector="disk", kv_role="prefill", kv_connector_config=cfg)
    decode = LLM(dtype="float32", num_gpu_blocks=64, kv_connector="disk", kv_role="decode", kv_connector_config=cfg)
    try:
        one = SamplingParams(max_tokens=1, temperature=0, structured_outputs=sp.structured_outputs)
        prefill.engine.add_request("p", ids, one, kv_transfer_params={"do_remote_decode": True,
                                                                      "do_remote_prefill": False})
        out = None
        while out is None:
            out = next((o for o in prefill.engine.step() if o.finished), None)
        assert out.error is None and out.outputs[0].text == "{"   # the prefill's token is masked too (then dropped)
        decode.engine.add_request("d", ids, sp, kv_transfer_params=out.kv_transfer_params)
        done = None
        while done is None:
            done = next((o for o in decode.engine.step() if o.finished), None)
        assert done.num_cached_tokens > 0 and done.outputs[0].token_ids == expected
        jsonschema.validate(json.loads(done.outputs[0].text), SCHEMA)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_compile_timeout_fails_cleanly(llm):
    """A grammar still compiling after the timeout: validate (the server's 400) and ready (the engine's error) both
    raise ValueError naming the timeout; nothing hangs."""
    m = StructuredOutputManager(llm.tokenizer, int(llm.engine.hf_config.vocab_size), [llm.engine.eos_token_id],
                                compile_timeout_s=0.2)
    gate = threading.Event()
    m._compile = lambda *a: gate.wait(30)   # a compile that takes "forever"
    try:
        with pytest.raises(ValueError, match="longer than 0.2s"):
            m.validate(SO(regex="a+"))
        m.add_request("r", SO(regex="a+"))
        m._requests["r"].added -= 1.0   # added a second ago
        with pytest.raises(ValueError, match="longer than 0.2s"):
            m.ready("r")
    finally:
        gate.set()
        m.shutdown()


def test_grammar_end_stops_the_request_even_with_ignore_eos(llm):
    """Once the grammar accepted its stop token nothing more is allowed: the request stops (not an all-masked step)."""
    eng = llm.engine
    eng.add_request("c", prompt(llm, "Yes or no?"), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                                   structured_outputs=SO(choice=["yes", "no"])))
    out = None
    while out is None:
        out = next((o for o in eng.step() if o.finished), None)
    c = out.outputs[0]
    assert out.error is None and c.finish_reason == "stop" and c.text in ("yes", "no")
    assert c.token_ids[-1] == eng.eos_token_id


def test_structural_tag_both_shapes(llm):
    """vLLM's {"structures", "triggers"} and xgrammar's {"type": "structural_tag", "format"}: free text, and the
    schema enforced between the tags; a malformed tag is refused with the reason."""
    m = llm.engine.structured
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    legacy = {"structures": [{"begin": "<f>", "schema": obj, "end": "</f>"}], "triggers": ["<f>"]}
    new = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
        {"begin": "<f>", "content": {"type": "json_schema", "json_schema": obj}, "end": "</f>"}]}}
    for i, tag in enumerate((legacy, new)):
        so = SO(structural_tag=json.dumps(tag))
        assert m.validate(so) == "xgrammar"
        for rid, text, ok in ((f"ok{i}", 'hi <f>{"a": 1}</f> ok', True), (f"bad{i}", 'hi <f>{"b": 1}</f>', False)):
            m.add_request(rid, so)
            assert m.ready(rid)
            assert m.accept(rid, llm.tokenizer.encode(text, add_special_tokens=False)) is ok
            m.remove(rid)
    with pytest.raises(ValueError, match="not recognized"):
        m.validate(SO(structural_tag=json.dumps({"type": "structural_tag", "format": {"type": "nope"}})))
