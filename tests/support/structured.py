"""Tool definitions and request helpers shared by the structured-output tests (one `pdserve serve`, `pdserve up`)."""

from __future__ import annotations

from typing import Any

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def schema_format(schema: dict[str, Any], name: str = "out") -> dict[str, Any]:
    """``response_format`` asking for ``schema`` (strict, as OpenAI's structured outputs)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def stream_chat(client: Any, **kwargs: Any) -> tuple[str, str | None, list]:
    """(content, finish_reason, tool-call deltas) reassembled from a chat stream of one choice."""
    text, finish, calls = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return text, finish, calls
