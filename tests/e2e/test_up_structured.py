"""Structured outputs and tool calling end to end: `pdserve up` (router -> prefill -> decode over the nixl KV
connector, the default model, float32) driven with the official openai client.

Twelve JSON schemas (nested objects, arrays with bounds, enums, patterns, bounded numbers, optional fields, anyOf/null,
const and $ref, additionalProperties: false), greedy and at temperature 0.7, streamed and not: every output parses and
validates with jsonschema, and greedy P/D output equals a monolithic engine's token for token. Also
``beta.chat.completions.parse`` with a pydantic model, regex and choice on 20 sampled outputs each, tools (required and
a named function, streamed and not) and a tool round trip; a constraint that cannot compile is the prefill pod's 400,
relayed by the router, and never reaches the decode pod.

Each test proves its requests went the disaggregated way, not a monolithic one: the router counted every one as
disaggregated with no fallback, both pods compiled each request's grammar (the decode pod, which samples every output
token, constrains from the first one), the decode pod loaded KV over the connector with no failed load and no
recomputed token, and each answer's prompt blocks came from that cache (``cached_tokens``). An unconstrained control
shows the prompts alone do not produce valid JSON: the grammar on the decode side does the work.

Cost: one `up` and one in-process engine for the module, short outputs (small maxLength/maxItems, the schema in the
prompt), requests sent concurrently.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
from typing import Any, Literal

import httpx
import jsonschema
import psutil
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from pdserve.runtime.metrics import parse_samples
from tests.support.server import free_port, launch_process
from tests.support.structured import TIME, TOOL_SCHEMAS, WEATHER, schema_format, stream_chat

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 300      # far above any schema's output here (whitespace runs are bounded by the backend)
SYSTEM = "Answer with compact JSON on one line."
BLOCK = 16            # the runtime's default KV block size: decode loads every full block of the prompt

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["city", "address"], "additionalProperties": False},
    "int array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                  "minItems": 2, "maxItems": 4},
    "tag list": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                           "minItems": 1, "maxItems": 3}},
                 "required": ["tags"], "additionalProperties": False},
    "enum pair": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                   "size": {"enum": ["S", "M", "L"]}},
                  "required": ["color", "size"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["sku", "date"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                                 "count": {"type": "integer", "minimum": -5, "maximum": 5},
                                                 "ok": {"type": "boolean"}},
                "required": ["score", "count", "ok"], "additionalProperties": False},
    "optional fields": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                                         "subtitle": {"type": "string", "maxLength": 10},
                                                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
                        "required": ["title"], "additionalProperties": False},
    "array of objects": {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "label": {"type": "string", "maxLength": 5}},
            "required": ["id", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
        "unit": {"type": ["string", "null"], "enum": ["kg", "lb", None]}},
        "required": ["value", "unit"], "additionalProperties": False},
    "line": {"type": "object", "$defs": {"pt": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "properties": {"kind": {"const": "line"}, "start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["kind", "start", "end"], "additionalProperties": False},
    "short code": {"type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4},
                                                    "flag": {"type": "boolean"}},
                   "required": ["code", "flag"], "additionalProperties": False},
}

TOOLS = [WEATHER, TIME]


def ask_weather(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {k}: what is the weather in Paris?"}]


def messages(name: str, k: int) -> list[dict[str, str]]:
    """The ask for ``name``; ``k`` makes each request's prompt its own (see ``PDCheck``)."""
    return [{"role": "system", "content": f"Request {k}. {SYSTEM}"},
            {"role": "user", "content": f"Give one example of a {name} as JSON matching this schema: "
                                        f"{json.dumps(SCHEMAS[name])}"}]


# (schema, streamed, temperature, seed): each greedy and at 0.7, streamed and not
CASES = [(name, stream, temp, None if temp == 0 else 100 + i)
         for i, (name, stream, temp) in enumerate((n, s, t) for n in SCHEMAS for s in (False, True)
                                                  for t in (0.0, 0.7))]


# ---- fixtures --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    """The monolithic reference: one in-process engine, float32 like the pods."""
    from pdserve.runtime import LLM

    llm = LLM(dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def monolithic_json(llm) -> dict[str, str]:
    """Greedy constrained output of every greedy case on the monolithic engine (one batch), by case number."""
    from pdserve.runtime import SamplingParams
    from pdserve.runtime.structured_output.params import StructuredOutputsParams

    greedy = [k for k, (_, _, temp, _) in enumerate(CASES) if temp == 0]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[CASES[k][0]])) for k in greedy]
    outs = llm.chat([messages(CASES[k][0], k) for k in greedy], params)
    return {k: o.outputs[0].text for k, o in zip(greedy, outs)}


class Up:
    def __init__(self, url: str, prefill: int, decode: int):
        self.url, self.prefill, self.decode = url, prefill, decode
        self.client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)

    def metrics(self) -> dict[str, dict[str, float]]:
        return {name: parse_samples(httpx.get(f"{base}/metrics", timeout=10).text)
                for name, base in (("router", self.url), ("prefill", f"http://127.0.0.1:{self.prefill}"),
                                   ("decode", f"http://127.0.0.1:{self.decode}"))}


@pytest.fixture(scope="module")
def up(monolithic_json):   # the reference first: the engine and `up` do not share the two cores
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--dtype", "float32", "--startup-timeout", "600"]
    with launch_process(cmd, port, timeout=900, stop_timeout=60) as handle:
        ports = {}
        for p in psutil.Process(handle.proc.pid).children(recursive=True):
            args = p.cmdline()
            if "--role" in args:
                ports[args[args.index("--role") + 1]] = int(args[args.index("--port") + 1])
        yield Up(handle.url, ports["prefill"], ports["decode"])


def family(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric family's samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if k.partition("{")[0] == name and all(w in k.partition("{")[2] for w in want))


class PDCheck:
    """Counter deltas over a block of requests: all of them went router -> prefill -> decode, the decode pod got each
    grammar and loaded the prompt's KV over the connector (no failed load, nothing recomputed).

    Every request of a block has a prompt of its own: the router rightly skips prefill for a prompt whose every token
    the decode pod already holds (``local_short``), so repeating one would let a request bypass P/D."""

    def __init__(self, up: Up):
        self.up, self.before = up, up.metrics()

    def delta(self, pod: str, name: str, **labels: str) -> float:
        return family(self.after[pod], name, **labels) - family(self.before[pod], name, **labels)

    def verify(self, requests: int, constrained: int) -> None:
        self.after = self.up.metrics()
        assert self.delta("router", "pdserve_router_pd_decisions_total", decision="disaggregated") == requests
        assert self.delta("router", "pdserve_router_pd_decisions_total") == requests
        assert self.delta("router", "pdserve_router_pd_fallbacks_total") == 0
        for pod in ("prefill", "decode"):   # both halves got the grammar
            assert self.delta(pod, "pdserve:structured_output_requests_total") == constrained, pod
        assert self.delta("decode", "pdserve:kv_connector_loads_total") >= 1
        assert self.delta("decode", "pdserve:kv_connector_blocks_loaded_total") >= 1
        assert self.delta("decode", "pdserve:kv_load_failures_total") == 0
        assert self.delta("decode", "pdserve:kv_connector_params_rejected_total") == 0
        assert self.delta("decode", "pdserve:recomputed_tokens_total") == 0
        assert self.delta("prefill", "pdserve:kv_connector_loads_total") == 0   # prefill never decodes


def loaded_prompt(usage) -> bool:
    """The decode pod computed none of the prompt's full blocks itself (they came over the connector)."""
    return usage.prompt_tokens_details.cached_tokens >= (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0


def run_all(jobs: list) -> list:
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda job: job(), jobs))


# ---- JSON schemas ----------------------------------------------------------------------------------------------------

def test_json_schemas_greedy_and_sampled_streamed_and_not(up, monolithic_json):
    client, check = up.client, PDCheck(up)

    def ask(k: int):
        name, stream, temp, seed = CASES[k]
        kwargs = dict(model=MODEL, messages=messages(name, k), max_tokens=MAX_TOKENS, temperature=temp, seed=seed,
                      response_format=schema_format(SCHEMAS[name], name.replace(" ", "_")))
        if stream:
            return lambda: stream_chat(client, **kwargs)[:2]

        def whole():
            r = client.chat.completions.create(**kwargs)
            assert loaded_prompt(r.usage), r.usage
            return r.choices[0].message.content, r.choices[0].finish_reason
        return whole

    control = lambda: client.chat.completions.create(   # noqa: E731: an ask of the same kind with no grammar
        model=MODEL, messages=messages("pattern", len(CASES)), max_tokens=40, temperature=0).choices[0].message.content
    results = run_all([ask(k) for k in range(len(CASES))] + [control])
    free = results.pop()
    check.verify(requests=len(CASES) + 1, constrained=len(CASES))

    for k, ((name, stream, temp, _), (text, finish)) in enumerate(zip(CASES, results)):
        assert finish == "stop", (name, stream, temp, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        if temp == 0:   # greedy, streamed or not: the monolithic engine's output token for token
            assert text == monolithic_json[k], (name, stream)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMAS["pattern"])


def test_pydantic_parse(up):
    class Address(BaseModel):
        city: str = Field(max_length=10)
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)
        role: Literal["admin", "user", "guest"]
        address: Address

    check = PDCheck(up)

    def parse(k: int, temperature: float, seed: int | None):
        ask = [{"role": "system", "content": f"Request {k}. {SYSTEM}"},
               {"role": "user", "content": "Describe a person as JSON with name, age, role and address (city, zip)."}]
        return lambda: up.client.beta.chat.completions.parse(model=MODEL, messages=ask, response_format=Person,
                                                             max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)

    results = run_all([parse(0, 0.0, None), parse(1, 0.7, 1), parse(2, 0.7, 2)])
    check.verify(requests=3, constrained=3)
    for r in results:
        assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)
        assert loaded_prompt(r.usage)


# ---- regex and choice ------------------------------------------------------------------------------------------------

def test_regex_and_choice_hold_on_20_samples_each(up):
    phone = r"\+1-[0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe so"]
    client, check = up.client, PDCheck(up)

    def regex(seed: int):
        return lambda: client.completions.create(
            model=MODEL, prompt=f"Office {seed}: our support line, open day and night, is reachable by phone at",
            max_tokens=16, temperature=0.9, seed=seed, extra_body={"structured_outputs": {"regex": phone}}).choices[0]

    def choice(seed: int):
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Question {seed}: is fire cold? yes, no or maybe so?"}],
            max_tokens=5, temperature=0.9, seed=seed,
            extra_body={"structured_outputs": {"choice": choices}}).choices[0]

    results = run_all([regex(s) for s in range(20)] + [choice(s) for s in range(20)])
    check.verify(requests=40, constrained=40)
    phones, answers = results[:20], results[20:]
    assert all(re.fullmatch(phone, c.text) and c.finish_reason == "stop" for c in phones), [c.text for c in phones]
    assert len({c.text for c in phones}) > 1   # sampled, not one greedy string twenty times
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in answers)


# ---- tools -----------------------------------------------------------------------------------------------------------

def test_tools_required_and_named_streamed_and_not_then_round_trip(up, llm):
    """required (one call) and a named function, greedy and sampled, streamed and not: one call with an id, the
    function's name and arguments that validate against its schema; then that call and a tool result go back as
    history, and the answer equals the monolithic engine's on the same tool-aware prompt (which holds the result)."""
    client, check = up.client, PDCheck(up)
    named = {"type": "function", "function": {"name": "get_time"}}
    one = {"parallel_tool_calls": False}
    cases = [("required", False, 0.0), ("required", True, 0.0), ("required", False, 0.7), ("required", True, 0.7),
             (named, False, 0.0), (named, True, 0.7)]

    def ask(k: int):
        choice, stream, temp = cases[k]
        kwargs = dict(model=MODEL, messages=ask_weather(k), tools=TOOLS, tool_choice=choice, max_tokens=60,
                      temperature=temp, seed=k, **(one if choice == "required" else {}))
        if not stream:
            return lambda: client.chat.completions.create(**kwargs).choices[0]

        def streamed():
            content, finish, deltas = stream_chat(client, **kwargs)
            # one call, index 0, one id, its name once, the arguments in pieces
            assert content == "" and {d.index for d in deltas} == {0}, (content, deltas)
            ids, names = [d.id for d in deltas if d.id], [d.function.name for d in deltas if d.function.name]
            assert len(ids) == 1 and ids[0].startswith("call_") and len(names) == 1, deltas
            return finish, names[0], "".join(d.function.arguments or "" for d in deltas)
        return streamed

    results = run_all([ask(k) for k in range(len(cases))])
    for (choice, stream, _), res in zip(cases, results):
        if not stream:
            assert res.message.content is None and len(res.message.tool_calls) == 1, res
            call = res.message.tool_calls[0]
            assert call.id.startswith("call_") and call.type == "function"
            res = res.finish_reason, call.function.name, call.function.arguments
        finish, fn, arguments = res
        assert finish == "tool_calls" and fn in TOOL_SCHEMAS and (choice == "required" or fn == "get_time")
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[fn])

    from pdserve.runtime import SamplingParams
    from pdserve.runtime.tool_calling.chat_template import render_chat_ids

    call = results[0].message.tool_calls[0]
    history = [*ask_weather(len(cases)),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16, temperature=0)
    check.verify(requests=len(cases) + 1, constrained=len(cases))
    ids = render_chat_ids(llm.tokenizer, history, tools=TOOLS, add_generation_prompt=True, override=None)
    rendered = llm.tokenizer.decode(ids)
    assert "21 degrees and sunny" in rendered and call.function.arguments in rendered
    reference = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert r.usage.prompt_tokens == len(ids) and loaded_prompt(r.usage)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (reference.text, reference.finish_reason)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nowhere"}}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
])
def test_bad_constraints_are_400_from_the_prefill_pod(up, extra, param):
    """The prefill pod refuses a constraint that cannot compile before queueing it; the router relays its 400 and never
    asks the decode pod."""
    before = up.metrics()
    with pytest.raises(BadRequestError) as e:
        up.client.chat.completions.create(model=MODEL, messages=ask_weather(0), max_tokens=5, **extra)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["message"] and (param is None or err["param"] == param)
    after = up.metrics()
    assert family(after["router"], "pdserve_router_requests_total", outcome="bad_request") == 1 + family(
        before["router"], "pdserve_router_requests_total", outcome="bad_request")
    for pod in ("prefill", "decode"):
        assert family(after[pod], "pdserve:structured_output_requests_total") == family(
            before[pod], "pdserve:structured_output_requests_total"), pod
    success = "vllm:request_success_total"
    assert family(after["decode"], success) == family(before["decode"], success)   # decode never saw it
