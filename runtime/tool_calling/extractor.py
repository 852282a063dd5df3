"""Turns one choice's text into OpenAI tool calls, whole (``result``) or as stream deltas (``update``).

Modes (``structured_output.api.tool_choice_mode``): ``named`` — the text is the named function's arguments (the grammar
made it so), streamed as incremental ``arguments``; ``required`` — the text is a JSON array of ``{"name",
"parameters"}``, each call sent when its object is complete; ``auto`` — the tool-call parser finds calls in free text
and the text before them stays content. Call ids are ``call_`` + random hex, fixed per call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pdserve.runtime.tool_calling.parsers import ToolParser, _call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_array(text: str, final: bool) -> list[dict[str, str]]:
    """Complete ``{"name", "parameters"}`` objects of a JSON array that may still be growing."""
    dec, calls = json.JSONDecoder(), []
    i = text.find("[")
    if i < 0:
        return calls
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return calls
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return calls
        call = _call(obj)
        if call is not None:
            calls.append(call)


class ToolCallExtractor:
    def __init__(self, mode: str, parser: ToolParser | None = None, name: str | None = None) -> None:
        self.mode, self.parser, self.name = mode, parser, name
        self.ids: list[str] = []
        self.sent_content = 0
        self.sent_calls = 0
        self.sent_args = 0          # named mode: characters of the arguments already streamed

    def _calls(self, text: str, final: bool) -> tuple[int, list[dict[str, str]]]:
        if self.mode == "named":
            return 0, [{"name": self.name, "arguments": text}]
        if self.mode == "required":
            return 0, _parse_array(text, final)
        return self.parser.parse(text, final)

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(new_call_id())
        return self.ids[index]

    def result(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content or None, OpenAI ``tool_calls``) of the finished text."""
        end, calls = self._calls(text, True)
        content = text[:end] if self.mode == "auto" else ""   # as streamed: deltas reassemble to it
        return (content if content.strip() else None), [{"id": self._id(i), "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(calls)]

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, ``delta.tool_calls`` entries) for what the cumulative ``text`` adds."""
        end, calls = self._calls(text, final)
        content = ""
        if self.mode == "auto" and end > self.sent_content:
            content, self.sent_content = text[self.sent_content:end], end
        deltas: list[dict[str, Any]] = []
        if self.mode == "named":
            args = calls[0]["arguments"]
            if self.sent_calls == 0:
                deltas.append({"index": 0, "id": self._id(0), "type": "function",
                               "function": {"name": self.name, "arguments": args}})
                self.sent_calls = 1
            elif len(args) > self.sent_args:
                deltas.append({"index": 0, "function": {"arguments": args[self.sent_args:]}})
            self.sent_args = len(args)
            return content, deltas
        for i in range(self.sent_calls, len(calls)):
            deltas.append({"index": i, "id": self._id(i), "type": "function",
                           "function": {"name": calls[i]["name"], "arguments": calls[i]["arguments"]}})
        self.sent_calls = max(self.sent_calls, len(calls))
        return content, deltas
