"""Structured outputs and tool calling through the real `pdserve serve` (default model, CPU) and the official openai
client: JSON schemas validated with jsonschema, regex / choice / grammar, tools required / named / auto, streaming that
reassembles to the whole response, n > 1, and 400s for bad input. One server for the module; small max_tokens."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.support.server import launch_server
from tests.support.structured import TIME, TOOL_SCHEMAS, WEATHER, schema_format, stream_chat

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                           "maximum": 1}}, "required": ["ok", "score"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "note": {"type": "string", "maxLength": 10}},
     "required": ["color"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def server():
    with launch_server("--max-model-len", "1024", "--num-gpu-blocks", "400", "--max-num-seqs", "16") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def stream_text(client, **kwargs) -> tuple[list[str], list[str | None]]:
    """(text of each choice, finish_reason of each) reassembled from a chat stream."""
    n = kwargs.get("n", 1)
    texts, finishes = [""] * n, [None] * n
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    return texts, finishes


# ---- JSON schema ----

def test_schemas_batched_with_an_unconstrained_request(client):
    """Four schemas, JSON mode and the same ask unconstrained, concurrently (constrained and free rows share steps):
    every constrained output validates, and the free one is no PERSON: the grammar does the work."""
    def ask(rf):
        extra = {"response_format": rf} if rf else {}
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100 if rf else 40, temperature=0,
                                              **extra)

    formats = [schema_format(s) for s in SCHEMAS] + [{"type": "json_object"}, None]
    with concurrent.futures.ThreadPoolExecutor(len(formats)) as pool:
        results = [r.choices[0] for r in pool.map(ask, formats)]
    for schema, c in zip(SCHEMAS, results):
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
    json_mode = results[len(SCHEMAS)]
    assert json_mode.message.content.startswith("{")
    if json_mode.finish_reason == "stop":
        assert isinstance(json.loads(json_mode.message.content), dict)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(results[-1].message.content), PERSON)


def test_sampled_streaming_with_n(client):
    """Temperature 0.7, n=3, streamed: every choice reassembles to a valid instance."""
    texts, finishes = stream_text(client, model=MODEL, messages=ASK, max_tokens=60, temperature=0.7, n=3, seed=7,
                                  response_format=schema_format(SCHEMAS[1]))
    assert finishes == ["stop"] * 3
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMAS[1])


def test_streaming_matches_whole_response(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=schema_format(SCHEMAS[3]))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    assert stream_text(client, **kwargs) == ([whole], ["stop"])


def test_completions_structured_outputs_with_logprobs_cut_by_max_tokens(client):
    """vLLM's structured_outputs on completions; a schema cut by max_tokens finishes with "length"; the logprobs of
    refused tokens (-inf) are left out, so every reported one is finite."""
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=6, temperature=0, logprobs=5,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text.startswith("{")
    assert all(lp > float("-inf") for top in c.logprobs.top_logprobs for lp in top.values())


def test_pydantic_parse(client):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Name a city."}],
                                           max_tokens=60, temperature=0, response_format=City)
    assert isinstance(r.choices[0].message.parsed, City)


# ---- regex, choice, grammar ----

def test_regex_choice_grammar(client):
    """20 sampled outputs each for a regex and a choice (n=20), and an EBNF grammar."""
    phone = r"\+1-[0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe so"]

    def regex(seed):
        return client.completions.create(model=MODEL, prompt="Phone:", max_tokens=16, temperature=0.9, seed=seed,
                                         n=10, extra_body={"structured_outputs": {"regex": phone}}).choices

    def choice(seed):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is fire cold?"}],
                                              max_tokens=5, temperature=0.9, seed=seed, n=10,
                                              extra_body={"structured_outputs": {"choice": choices}}).choices

    with concurrent.futures.ThreadPoolExecutor(4) as pool:   # n is at most 16: two requests of 10 each
        phones = [c for f in [pool.submit(regex, s) for s in (1, 2)] for c in f.result()]
        answers = [c for f in [pool.submit(choice, s) for s in (1, 2)] for c in f.result()]
    assert len(phones) == 20 and all(re.fullmatch(phone, c.text) and c.finish_reason == "stop" for c in phones)
    assert len(answers) == 20 and all(c.message.content in choices for c in answers)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    r = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=12, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    c = r.choices[0]
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", c.text) if c.finish_reason == "stop" else c.text.startswith("(")


# ---- tools ----

def test_tool_choice_required_and_named(client):
    """required: one valid call of one of the tools; named: that function's arguments, streamed (incremental
    arguments under one call id) and not, both validating against its schema."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}

    def required():
        return client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=50,
                                              temperature=0).choices[0]

    def named_streamed():
        args, names, ids, finish = "", set(), set(), None
        for chunk in client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                                    tool_choice=named, max_tokens=40, temperature=0, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    assert d.index == 0
                    names |= {d.function.name} - {None}
                    args += d.function.arguments or ""
                    ids |= {d.id} - {None}
        return args, names, ids, finish

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        req, stream = pool.submit(required), pool.submit(named_streamed)
        whole = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                               max_tokens=40, temperature=0).choices[0]
        c, (args, names, ids, finish) = req.result(), stream.result()
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])

    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS["get_time"])
    assert names == {"get_time"} and len(ids) == 1 and finish == "tool_calls"
    assert args == call.function.arguments   # streamed arguments reassemble to the whole response's


def test_tool_choice_auto_parses_a_scripted_hermes_call(client):
    """The 135M model does not call tools by itself: a regex scripts its output into a hermes call, which the
    parser (--tool-call-parser hermes) turns into tool_calls, streamed and not."""
    script = (r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "C"\}\}'
              r'\n</tool_call>')
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                  max_tokens=50, temperature=0, extra_body={"structured_outputs": {"regex": script}})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(stream_chat, client, **kwargs)
        c = client.chat.completions.create(**kwargs).choices[0]
        content, finish, calls = stream.result()
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure.\n"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert content == "Sure.\n" and finish == "tool_calls" and "<tool_call>" not in content
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [(0, "get_weather",
                                                                                   call.function.arguments)]
    assert calls[0].id.startswith("call_")


def test_tool_round_trip(client):
    """An assistant turn with tool_calls and a tool result render into the next prompt (built-in tool template)."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100   # the tools were in the prompt


# ---- bad input ----

@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "\x16"}}, "structured_outputs"),   # no token of this vocabulary can start it
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_input_is_400(server, body, param):
    """An OpenAI-shaped 400 naming the field, before the engine queues anything (the engine counts every queued
    structured-output request by kind; a grammar that failed there would be a 503)."""
    def queued() -> float:
        from pdserve.runtime.metrics import parse_samples

        s = parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)
        return sum(v for k, v in s.items() if k.startswith("pdserve:structured_output_requests_total{"))

    before = queued()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert queued() == before
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_constraint_no_token_can_continue_is_the_clients_400(server):
    """A regex whose first byte has a token and whose second has none (this tokenizer has no token for \\x16): the
    request reaches a state no token continues. It ends as an OpenAI-shaped 400 (a stream: an invalid_request_error
    event, then [DONE]), not the engine's 503, and the server keeps serving."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "structured_outputs": {"regex": "a\x16"}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "structured_output_dead_end"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "stream": True})
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [(e["type"], e["code"]) for e in errors] == [("invalid_request_error", "structured_output_dead_end")]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_k": 94, "top_p": 0.43, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_min_tokens_past_where_the_constraint_must_stop_is_the_clients_400(server, sampling):
    """The regex "a" leaves only the stop token after one token, and min_tokens=5 holds the stop tokens back: no
    token is left. It ends as the dead-end 400 naming min_tokens (it was a 503 "grammar refused a token": the row's
    logits were all -inf and the sampler's pick was arbitrary), and a min_tokens the constraint allows is served."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "structured_outputs": {"regex": "a"}, **sampling}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "min_tokens": 5})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "structured_output_dead_end" and "min_tokens=5" in err["message"], err
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "min_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "a", r.text


def test_metrics(server):
    """Run last in the module: the requests above compiled grammars, hit the cache and were counted by kind."""
    from pdserve.runtime.metrics import parse_samples

    s = parse_samples(httpx.get(server.url + "/metrics", timeout=10).text)
    label = f'model_name="{MODEL}"'
    assert s[f"pdserve:grammar_compile_seconds_count{{{label}}}"] >= 5
    assert s[f"pdserve:grammar_cache_hits_total{{{label}}}"] >= 1
    assert s[f'pdserve:structured_output_requests_total{{kind="json",{label}}}'] >= 5
    assert s[f'pdserve:structured_output_requests_total{{kind="regex",{label}}}'] >= 20
