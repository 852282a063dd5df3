"""The request surface: ``response_format``, vLLM's ``structured_outputs`` and ``tools`` + ``tool_choice`` -> one
``StructuredOutputsParams`` (or None). Every malformed shape is an ``ApiError`` 400 naming the field; whether the
schema, regex or grammar compiles is checked next by the engine's manager (``StructuredOutputManager.validate``).

Tools: ``tool_choice="required"`` constrains the output to a JSON array of ``{"name", "parameters"}`` objects, one
schema branch per tool (at most one item when ``parallel_tool_calls`` is false); a named function constrains it to that
function's parameters. ``auto`` and ``none`` add no constraint (``auto`` output goes through the tool-call parser).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.runtime.protocol import ApiError
from pdserve.runtime.structured_output.params import StructuredOutputsParams

SO_FIELDS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
             "disable_additional_properties", "disable_fallback", "whitespace_pattern"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice_mode(req: Any) -> str:
    """none | auto | required | named (a request without tools: none)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools:
        return "none"
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else "named"


def request_params(req: Any) -> tuple[str, StructuredOutputsParams] | None:
    """(the request field it came from, the structured-output constraint) a chat or completion request asks for, or
    None (ApiError 400 if malformed)."""
    found = [(p, v) for p, v in (("response_format", _from_response_format(req.response_format)),
                                 ("structured_outputs", _from_structured_outputs(req.structured_outputs)),
                                 ("tool_choice", _from_tools(req))) if v is not None]
    if len(found) > 1:
        raise ApiError(400, f"{found[0][0]} and {found[1][0]} both constrain the output; use one",
                       param=found[1][0])
    return found[0] if found else None


def _make(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        so = StructuredOutputsParams(**kwargs)
        so.key()   # JSON text that does not parse, a schema that is not an object
    except (ValueError, TypeError) as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return so


def _from_response_format(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema'",
                           param="response_format.json_schema")
        schema = js.get("schema", js.get("json_schema"))
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format.json_schema.schema")
        return _make("response_format.json_schema.schema", json=schema)
    if kind == "structural_tag":   # vLLM's extension: the response_format object is the structural tag
        return _make("response_format", structural_tag=json.dumps(rf))
    raise ApiError(400, f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
                        "structural_tag)", param="response_format.type")


def _from_structured_outputs(so: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if so is None:
        return None
    param = "structured_outputs"
    unknown = set(so) - SO_FIELDS
    if unknown:
        raise ApiError(400, f"{param}: unknown field(s) {', '.join(sorted(unknown))}", param=param)
    if so.get("whitespace_pattern") is not None:
        raise ApiError(400, f"{param}.whitespace_pattern is not supported (use disable_any_whitespace)",
                       param=f"{param}.whitespace_pattern")
    types = {"json": (str, dict), "regex": str, "grammar": str, "structural_tag": (str, dict), "json_object": bool,
             "disable_any_whitespace": bool, "disable_additional_properties": bool, "disable_fallback": bool,
             "choice": list}
    for k, t in types.items():
        if so.get(k) is not None and not isinstance(so[k], t):
            raise ApiError(400, f"{param}.{k} has the wrong type", param=f"{param}.{k}")
    args = {k: so[k] for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag",
                               "disable_any_whitespace", "disable_additional_properties") if so.get(k) is not None}
    if isinstance(args.get("structural_tag"), dict):
        args["structural_tag"] = json.dumps(args["structural_tag"])
    if args.get("json_object") is False:
        del args["json_object"]
    return _make(param, **args)


def _from_tools(req: Any) -> StructuredOutputsParams | None:
    mode = tool_choice_mode(req)
    if mode in ("none", "auto"):
        return None
    if mode == "named":
        name = req.tool_choice.function.name
        fn = next(t.function for t in req.tools if t.function.name == name)
        return _make("tools", json=fn.parameters or EMPTY_PARAMETERS)
    branches = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                  "parameters": t.function.parameters or EMPTY_PARAMETERS},
                 "required": ["name", "parameters"]} for t in req.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return _make("tools", json=schema)
