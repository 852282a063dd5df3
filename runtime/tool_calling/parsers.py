"""Tool-call parsers for ``tool_choice="auto"``: find the calls a model wrote in its own text format.

A parser is registered by name (``--tool-call-parser``, vLLM's names). ``parse(text, final)`` reads the cumulative
text and returns ``(content_end, calls)``: the text before ``content_end`` is plain content the client may already see
(streaming holds back anything that could still become a call), ``calls`` every complete call so far as
``{"name", "arguments"}`` with ``arguments`` a JSON string. Stateless: streaming calls it again on the longer text.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any


class ToolParser(ABC):
    name: str

    @abstractmethod
    def parse(self, text: str, final: bool) -> tuple[int, list[dict[str, str]]]: ...


def _call(obj: Any) -> dict[str, str] | None:
    """``{"name", "arguments"}`` from a decoded call object (hermes writes ``arguments``; some models ``parameters``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """Hermes / Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)

    def parse(self, text: str, final: bool) -> tuple[int, list[dict[str, str]]]:
        start = text.find(self.START)
        if start < 0:
            return (len(text) if final else len(text) - _held_back(text, self.START)), []
        calls = []
        for m in self.BLOCK.finditer(text, start):
            body = m.group(1) if m.group(1) is not None else (m.group(2) if final else None)
            if body is None:
                continue
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if final and not calls:   # nothing parseable: it was content after all (as vLLM does)
            return len(text), []
        return start, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def create_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}") from None
