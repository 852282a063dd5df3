"""Reading a request's JSON body at the trust boundary, before pydantic sees it: bounded size (413), bounded nesting,
no NaN/Infinity, no lone surrogates (400). The exact bytes are kept on ``request.state.raw_body`` because the KV
handoff check MACs them (kv_connectors/kv_auth.py)."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from pdserve.runtime.protocol import ApiError

MAX_BODY_BYTES = 32 * 2**20   # request bodies beyond this are refused (413) before being read into memory
MAX_JSON_DEPTH = 64           # nesting beyond this is refused (400): no OpenAI body comes close


async def read_json(request: Request) -> Any:
    """The parsed body of ``request``; an ``ApiError`` (413/400) for anything the checks above refuse."""
    length = request.headers.get("content-length", "0")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body must be at most {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body must be at most {MAX_BODY_BYTES} bytes")
    request.state.raw_body = data = bytes(raw)
    try:
        text = data.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, ints beyond 4300 digits
        raise ApiError(400, f"malformed JSON body: {str(e)[:200]}") from None
    _check_json_values(body, check_strings="\\u" in text)
    return body


def raw_body(request: Request) -> bytes:
    """The exact bytes ``read_json`` read (empty before it ran)."""
    return getattr(request.state, "raw_body", b"")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_json_values(body: Any, check_strings: bool) -> None:
    """Nesting depth (deep bodies would overflow the stack of whatever walks them next) and, when the text had
    ``\\u`` escapes, lone surrogates (they cannot be tokenized or encoded back to UTF-8)."""
    todo = [(body, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ApiError(400, f"JSON body nested deeper than {MAX_JSON_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            todo += [(x, depth + 1) for kv in items for x in kv if isinstance(x, (dict, list, str))]
        elif check_strings and isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "malformed JSON body: a string holds a lone UTF-16 surrogate") from None
