"""Tool-call parsing and the request surface, without a model: the hermes parser on crafted outputs (whole and
streamed in every split), the required/named extractors, request -> StructuredOutputsParams mapping and its 400s."""

from __future__ import annotations

import json

import pytest

from pdserve.runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse
from pdserve.runtime.structured_output.api import request_params, tool_choice_mode
from pdserve.runtime.tool_calling import ToolCallExtractor, create_tool_parser

TEXT = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def streamed(ex: ToolCallExtractor, text: str, step: int) -> tuple[str, list[dict]]:
    content, calls = "", []
    for end in range(step, len(text) + step, step):
        c, d = ex.update(text[:end], end >= len(text))
        content += c
        calls += d
    return content, calls


def test_hermes_whole_output():
    content, calls = ToolCallExtractor("auto", create_tool_parser("hermes")).result(TEXT)
    assert content == "I will look both up.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_streamed_in_any_split_reassembles_to_the_whole(step):
    """No "<tool_call>" fragment ever leaks into the content, whatever the split; each call is sent once."""
    content, deltas = streamed(ToolCallExtractor("auto", create_tool_parser("hermes")), TEXT, step)
    assert content == "I will look both up.\n"
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(CALLS)]


def test_hermes_unterminated_and_invalid_calls():
    parser = create_tool_parser("hermes")
    ex = ToolCallExtractor("auto", parser)
    content, calls = ex.result('<tool_call>\n{"name": "f", "arguments": {}}')   # stopped before </tool_call>
    assert content is None and calls[0]["function"]["name"] == "f"
    text = "maybe <tool_call>{not json}</tool_call>"
    assert ToolCallExtractor("auto", parser).result(text) == (text, [])   # nothing parseable: all content
    assert streamed(ToolCallExtractor("auto", parser), "plain text, no calls", 4) == ("plain text, no calls", [])
    with pytest.raises(ValueError, match="unknown tool call parser"):
        create_tool_parser("nope")


def test_required_and_named_extractors():
    arr = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "CET"}}]'
    content, calls = ToolCallExtractor("required").result(arr)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    _, deltas = streamed(ToolCallExtractor("required"), arr, 5)
    assert [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]
    args = '{"tz": "CET"}'
    _, deltas = streamed(ToolCallExtractor("named", name="get_time"), args, 4)
    assert deltas[0]["function"]["name"] == "get_time" and "id" in deltas[0]
    assert all("id" not in d for d in deltas[1:]) and "".join(d["function"]["arguments"] for d in deltas) == args


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSG = [{"role": "user", "content": "x"}]


def chat(**body):
    return parse(ChatCompletionRequest, {"messages": MSG, **body})


def test_request_mapping():
    assert request_params(chat()) is None and request_params(chat(response_format={"type": "text"})) is None
    param, so = request_params(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}))
    assert param == "response_format" and so.kind == "json" and json.loads(so.spec()) == {"type": "object"}
    assert request_params(chat(response_format={"type": "json_object"}))[1].kind == "json_object"
    so = request_params(parse(CompletionRequest, {"prompt": "p", "structured_outputs": {"choice": ["a", "b"]}}))[1]
    assert so.kind == "choice" and so.choice == ("a", "b")
    so = request_params(chat(structured_outputs={"json": '{"type": "object", "properties": {"a": {}}}',
                                                 "disable_additional_properties": True}))[1]
    assert json.loads(so.spec())["additionalProperties"] is False
    assert tool_choice_mode(chat(tools=[WEATHER])) == "auto" and request_params(chat(tools=[WEATHER])) is None
    param, so = request_params(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(so.spec())
    assert param == "tool_choice" and schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == \
        ["get_weather"]
    so = request_params(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))[1]
    assert json.loads(so.spec()) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
    {"structured_outputs": {"json": "{not json"}},
    {"structured_outputs": {"regex": 5}},
    {"structured_outputs": {}},
    {"structured_outputs": {"whitespace_pattern": " "}},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
    {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
    {"tool_choice": "required"},
    {"tools": [WEATHER], "tool_choice": "sometimes"},
])
def test_malformed_shapes_are_400(body):
    with pytest.raises(ApiError) as e:
        request_params(chat(**body))
    assert e.value.status == 400 and e.value.message
