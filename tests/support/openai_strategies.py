"""Hypothesis strategies for hostile OpenAI request bodies, shared by the server and router fuzz tests.

``completion_bodies(model)`` and ``chat_bodies(model)`` draw request dicts shaped like ``/v1/completions`` and
``/v1/chat/completions`` bodies (every field of pdserve's request models, OpenAI's and vLLM's extras, plus unknown
keys), in three equal shares: well-formed (in-range values, int64 edges included: these must be served); well-formed
but for one numeric field set to an edge value (int64/uint64 edges and beyond, huge ints, tiny and huge floats: the
shape that reaches the engine); and hostile, where any field may be out of range, of the wrong type, unicode, or
nested JSON. ``RAW_BODIES`` are byte bodies a JSON encoder would never produce (NaN, ``1e999``, 5,000-digit integers, deep
nesting, lone surrogates, invalid UTF-8). ``encode`` turns a drawn dict into bytes.

Cost bound: a body that the server accepts asks for at most ``MAX_TOKENS`` tokens per choice and at most 3 choices
(``max_tokens`` is always present and never null, so no request runs to the end of the context).

``structured_bodies(model, chat)`` draws well-formed bodies whose structured-output and tool fields take valid,
broken and junk shapes (those fields reach the grammar compiler there).

``router_requests(model)`` draws what a client sends the router: ``(path, body bytes, headers)``, the bodies above with
hostile values in the fields the router itself reads (prompt and message text that looks like chat-template markup,
P/D ``kv_transfer_params`` naming other hosts, request ids, cache salts), routing headers, raw bodies and binary junk.

``assert_openai_error(status, content)`` checks that a non-2xx answer is OpenAI-shaped:
``{"error": {"message": str, "type": str, "code": ...}}``.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MAX_TOKENS = 4
VOCAB = 49_152   # the default model's; ids beyond it must be refused
INT_EDGES = [0, 1, -1, 2, 17, 21, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
             -(2**63) - 1, 10**30]
FLOAT_EDGES = [0.0, 5e-324, 1e-6, 0.5, 2.0000001, -2.0000001, 100.5, 1e308, -1e308]
HOSTILE_IDS = ["x\r\ny", "x\ny", "日本語", "é", "a#0", "", " ", "a" * 300, "tab\tid", "ok-id_1.2"]


def huge_ints() -> st.SearchStrategy[int]:
    return st.sampled_from(INT_EDGES) | st.integers()


def numbers() -> st.SearchStrategy[Any]:
    return huge_ints() | st.sampled_from(FLOAT_EDGES) | st.floats(allow_nan=False, allow_infinity=False)


def texts(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.text(max_size=max_size)   # any code point but surrogates (see RAW_BODIES for those)


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | numbers() | texts(8)
    return st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts(6), kids, max_size=3),
                        max_leaves=max_leaves)


def junk() -> st.SearchStrategy[Any]:
    """A value of the wrong type for most fields (never null: see ``field``)."""
    return (st.booleans() | texts(8) | st.lists(huge_ints(), max_size=3)
            | st.dictionaries(texts(4), huge_ints(), max_size=2))


def field(valid: st.SearchStrategy[Any], hostile: bool, *, null: bool = True) -> st.SearchStrategy[Any]:
    """``valid``; in a hostile body, a third of the time a hostile number or a wrong type (or null when ``null``)."""
    if not hostile:
        return valid
    return st.one_of(valid, valid, numbers() | junk() | (st.none() if null else st.nothing()))


def _token_ids(in_vocab: bool) -> st.SearchStrategy[list[int]]:
    if in_vocab:
        return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
    return st.lists(st.integers(0, VOCAB + 10_000) | huge_ints(), max_size=8)


def _int64(margin: int = 0) -> st.SearchStrategy[int]:
    hi = 2**63 - 1 - margin
    return st.sampled_from([-(2**63), hi, 0]) | st.integers(-(2**63), hi)


def _sampling_fields(model: str, h: bool) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "model": st.sampled_from([model, "gpt-4o", ""]) | junk() if h else st.just(model),
        "n": field(st.integers(1, 3), h),
        "stream": field(st.booleans(), h),
        "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans(), h)}), h),
        "temperature": field(st.floats(0, 2) | st.sampled_from([0, 1e-9, 100]), h),
        "top_p": field(st.floats(0, 1, exclude_min=True), h),
        "top_k": field(st.integers(-1, 100) | st.just(2**31 - 1), h),
        "min_p": field(st.floats(0, 1), h),
        "seed": field(_int64(margin=2), h),   # n <= 3: child seeds seed + i stay within int64
        "stop": field(texts(4).filter(bool) | st.lists(texts(4).filter(bool), max_size=3), h),
        "stop_token_ids": field(_token_ids(in_vocab=not h), h),
        "presence_penalty": field(st.floats(-2, 2), h),
        "frequency_penalty": field(st.floats(-2, 2), h),
        "repetition_penalty": field(st.floats(0.5, 2), h),
        "min_tokens": field(st.integers(0, 1), h),
        "ignore_eos": field(st.booleans(), h),
        "skip_special_tokens": field(st.booleans(), h),
        "include_stop_str_in_output": field(st.booleans(), h),
        "user": field(texts(8), h),
        "request_id": (field(st.sampled_from(HOSTILE_IDS) | texts(12), h) if h
                       else st.text("abcXYZ019-_.:", min_size=1, max_size=16)),
        "priority": field(_int64(), h),
        "truncate_prompt_tokens": field(st.integers(1, 300), h),
        "cache_salt": field(texts(8).filter(bool), h),
        **({"logit_bias": field(st.dictionaries(st.integers(0, VOCAB + 10).map(str) | texts(4), numbers(),
                                                max_size=2), h),
            "kv_transfer_params": field(st.dictionaries(texts(8), json_values(), max_size=3), h)} if h else {}),
    }


def _max_tokens(h: bool) -> st.SearchStrategy[Any]:
    return field(st.integers(1, MAX_TOKENS), h, null=False)


def _with_extras(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Unknown keys (clients send ``user``, ``metadata``...; a server must ignore or refuse them cleanly)."""
    extras = st.dictionaries(st.sampled_from(["metadata", "x_extra", "functions", "parallel_tool_calls"]) | texts(6),
                             json_values(4), max_size=2)
    return st.tuples(extras, body).map(lambda t: {**t[0], **t[1]})


def _completion(model: str, h: bool) -> st.SearchStrategy[dict[str, Any]]:
    ids = _token_ids(in_vocab=not h)
    prompt = field(texts(40).filter(bool) | ids | st.lists(texts(12).filter(bool), min_size=1, max_size=2 if h else 1)
                   | st.lists(ids, min_size=1, max_size=2 if h else 1), h)
    optional = {**_sampling_fields(model, h), **(_structured_fields(h, chat=False) if h else {}),
                "logprobs": field(st.integers(0, 5), h),
                "echo": field(st.just(False), h), "suffix": field(st.just(""), h),
                **({"best_of": field(st.integers(1, 3), h)} if h else {})}
    return _with_extras(st.fixed_dictionaries({"prompt": prompt, "max_tokens": _max_tokens(h)}, optional=optional))


def _messages(h: bool) -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | junk() if h else st.just("text"),
                                  "text": field(texts(12), h)})
    roles = ["system", "developer", "user", "assistant", "tool"] + (["wizard"] if h else [])
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(roles) | junk() if h else st.sampled_from(roles),
         "content": field(texts(40) | st.lists(part, max_size=2), h)},
        optional={"name": field(texts(6), h)})
    messages = st.lists(message, min_size=1, max_size=3)
    return st.one_of(messages, messages, junk()) if h else messages


def _schemas() -> st.SearchStrategy[Any]:
    """JSON Schema-like objects: valid small ones, broken types, bad patterns and plain junk."""
    leaf = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "object",
                                                           "array", "null", "objectx"])},
                                 optional={"pattern": st.sampled_from(["^a+$", "((", "[0-9]{2}"]),
                                           "enum": st.lists(json_values(1), max_size=3),
                                           "minimum": numbers(), "maxLength": st.integers(-1, 5),
                                           "minItems": st.integers(-1, 3), "allOf": st.just([{"type": "integer"}])})
    obj = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(texts(6), leaf,
                                                                                          max_size=3)},
                                optional={"required": st.lists(texts(6), max_size=2),
                                          "additionalProperties": st.booleans()})
    return st.one_of(leaf, obj, json_values(4))


def _structured_fields(h: bool, chat: bool) -> dict[str, st.SearchStrategy[Any]]:
    """response_format / structured_outputs (and tools / tool_choice for chat), hostile shapes included."""
    rf = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag", "xml"]) | junk()},
        optional={"json_schema": st.fixed_dictionaries({"name": texts(8), "schema": _schemas()},
                                                       optional={"strict": st.booleans()}) | junk()})
    so = st.fixed_dictionaries({}, optional={
        "json": _schemas(), "regex": st.sampled_from(["[a-z]{1,3}", "((", "a|b", ""]) | texts(6),
        "choice": st.lists(texts(4), max_size=3) | junk(), "grammar": st.sampled_from(['root ::= "a"', "root ::= ("]),
        "json_object": st.booleans(), "structural_tag": junk(), "disable_any_whitespace": st.booleans(),
        "bogus": junk()})
    fields = {"response_format": field(rf, h), "structured_outputs": field(so | junk(), h)}
    if chat:
        tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "bad name"]) | texts(6)}, optional={"parameters": _schemas()})})
        fields["tools"] = field(st.lists(tool | json_values(3), max_size=2), h)
        fields["tool_choice"] = field(st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "x"])})})
            | junk(), h)
        fields["parallel_tool_calls"] = field(st.booleans(), h)
    return fields


def _chat(model: str, h: bool) -> st.SearchStrategy[dict[str, Any]]:
    optional = {**_sampling_fields(model, h), "max_completion_tokens": _max_tokens(h),
                "logprobs": field(st.booleans(), h), "top_logprobs": field(st.integers(0, 5), h),
                "add_generation_prompt": field(st.booleans(), h),
                **(_structured_fields(h, chat=True) if h else {})}
    return _with_extras(st.fixed_dictionaries({"messages": _messages(h), "max_tokens": _max_tokens(h)},
                                              optional=optional))


# Numeric fields that reach the engine (max_tokens left out: an in-range big value only makes a run slow).
NUMERIC_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "priority", "truncate_prompt_tokens", "stop_token_ids"]
EDGE_VALUES = [*INT_EDGES, *FLOAT_EDGES, VOCAB]


def numeric_edges(fields: list[str] = NUMERIC_FIELDS) -> list[tuple[str, Any]]:
    """Every (field, edge value) pair: ``body | {field: value}`` (a list for ``stop_token_ids``) is one probe."""
    return [(f, [v] if f == "stop_token_ids" else v) for f in fields for v in EDGE_VALUES]


def _one_bad_number(clean: st.SearchStrategy[dict[str, Any]], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A well-formed body with one numeric field set to an edge value: the shape that reaches the engine."""
    return st.tuples(clean, st.sampled_from(numeric_edges(fields))).map(lambda t: {**t[0], t[1][0]: t[1][1]})


def completion_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    clean = _completion(model, False)
    return st.one_of(clean, _one_bad_number(clean, NUMERIC_FIELDS + ["logprobs"]), _completion(model, True))


def chat_bodies(model: str) -> st.SearchStrategy[dict[str, Any]]:
    clean = _chat(model, False)
    return st.one_of(clean, _one_bad_number(clean, NUMERIC_FIELDS + ["top_logprobs"]), _chat(model, True))


def _one_constraint(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    """One structured-output source at a time, mostly well-shaped (so it reaches the compiler) around schemas, regexes
    and grammars that may not compile; now and then two sources at once or an unknown key."""
    rf = st.one_of(st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                       {"name": texts(8), "schema": _schemas()}, optional={"strict": st.booleans()})}),
                   st.just({"type": "json_object"}),
                   st.fixed_dictionaries({"type": st.sampled_from(["text", "xml", "structural_tag"])},
                                         optional={"json_schema": junk()}))
    kinds = {"json": _schemas(), "regex": st.sampled_from(["[a-z]{1,3}", "((", "a|b", "", "[0-9]+"]) | texts(6),
             "grammar": st.sampled_from(['root ::= "a"', "root ::= (", 'root ::= [0-9]+ "!"', "root ::= undefined"]),
             "choice": st.lists(texts(4), max_size=3), "json_object": st.just(True)}
    so = st.sampled_from(list(kinds)).flatmap(lambda k: st.fixed_dictionaries(
        {k: kinds[k]}, optional={"disable_any_whitespace": st.booleans(), "bogus": junk(),
                                 **({"choice": kinds["choice"]} if k != "choice" else {})}))   # choice: a second kind
    options = [st.fixed_dictionaries({"structured_outputs": so}), st.fixed_dictionaries({"response_format": rf})]
    if chat:
        tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g", "bad name"])}, optional={"parameters": _schemas()})})
        choice = st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "x"])})})
        options.append(st.fixed_dictionaries({"tools": st.lists(tool, min_size=1, max_size=2)},
                                             optional={"tool_choice": choice, "parallel_tool_calls": st.booleans()}))
    one = st.one_of(options)
    both = st.tuples(one, one).map(lambda t: {**t[0], **t[1]})
    return st.one_of(one, one, one, both)


def structured_bodies(model: str, chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Well-formed bodies with one structured-output source (``response_format``, ``structured_outputs``, or for chat
    ``tools`` + ``tool_choice``), compiling or not. In the bodies above these fields ride only on hostile bodies, which
    some other field gets refused first: here they reach the structured-output parsing and the grammar compiler, and
    the ones that compile are served under their grammar."""
    clean = _chat(model, False) if chat else _completion(model, False)
    return st.tuples(clean, _one_constraint(chat)).map(lambda t: {**t[0], **t[1]})


def _nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"a": ' + b"[" * depth + b"]" * depth + b"}}"


RAW_BODIES: list[bytes] = [
    b"[" * 100_000 + b"]" * 100_000,                 # RecursionError in a recursive JSON parser
    b"{" + b'"a":{' * 50_000 + b"}" * 50_001,
    _nested(900),                                      # parses, but deep enough to break whatever walks it next
    _nested(200),
    b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
    b'{"prompt": "hi", "max_tokens": 1, "top_p": Infinity}',
    b'{"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"x": -Infinity}}',
    b'{"prompt": "hi", "max_tokens": 1, "temperature": 1e999}',
    b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi \\ud800 there", "max_tokens": 1}',   # a lone surrogate escape
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
    b'{"prompt": "caf\xe9", "max_tokens": 1}',        # latin-1, not UTF-8
    b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}',   # a UTF-8-encoded surrogate
    b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}',  # a UTF-8 byte order mark
    b'{"prompt": "hi", "max_tokens": 1, "request_id": "x\\r\\ny"}',
    b'{"prompt": "hi", "max_tokens": 1, "request_id": "\\u65e5\\u672c"}',
    b'{"prompt": "hi", "prompt": [1, 2], "max_tokens": 1}',
    b"null", b"[]", b'"prompt"', b"1e999", b"", b"{", b"{}",
]


# ---- what the router reads ----------------------------------------------------------------------------------------

# Text the router tokenizes or templates itself (prefix routing, P/D threshold): markup, control characters, long runs.
ODD_TEXTS = ["", " ", "\r\n", "x\r\ny", "\x00", "café", "日本語", "\U0001f375", "<|im_start|>", "<|im_end|>system",
             "{{ raise }}", "{% for %}", "\\u0000", "a" * 300]
ROLES = ["system", "developer", "user", "assistant", "tool"]


def odd_texts() -> st.SearchStrategy[str]:
    return st.text(max_size=40) | st.sampled_from(ODD_TEXTS)


def kv_transfer_params() -> st.SearchStrategy[Any]:
    """P/D handoff parameters as a client might forge them (the router must never let them pick a host)."""
    forged = st.fixed_dictionaries({"do_remote_prefill": st.booleans(), "do_remote_decode": st.booleans(),
                                    "remote_host": st.sampled_from(["127.0.0.1", "10.9.9.9", "::1"]),
                                    "remote_port": st.integers(-1, 70000),
                                    "remote_block_ids": st.lists(st.integers(-5, 10**9), max_size=3)})
    return forged | json_values()


def _router_fields(chat: bool) -> st.SearchStrategy[dict[str, Any]]:
    text_fields = ({"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": odd_texts()}),
                                         min_size=1, max_size=3)} if chat
                   else {"prompt": odd_texts() | st.lists(odd_texts(), min_size=1, max_size=2)})
    return st.fixed_dictionaries({}, optional={**text_fields, "kv_transfer_params": kv_transfer_params(),
                                               "request_id": odd_texts() | junk(), "cache_salt": odd_texts()})


def router_requests(model: str) -> st.SearchStrategy[tuple[str, bytes, dict[str, str]]]:
    """``(path, body bytes, headers)``: mostly JSON bodies (the shared ones, router fields overridden), sometimes raw."""
    def merged(bodies: st.SearchStrategy[dict[str, Any]], chat: bool) -> st.SearchStrategy[dict[str, Any]]:
        return st.tuples(bodies, _router_fields(chat)).map(lambda t: {**t[0], **t[1]} if isinstance(t[0], dict)
                                                           else t[0])
    as_json = st.one_of(st.tuples(st.just("/v1/completions"), merged(completion_bodies(model), False).map(encode)),
                        st.tuples(st.just("/v1/chat/completions"), merged(chat_bodies(model), True).map(encode)))
    raw = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                    st.sampled_from(RAW_BODIES) | st.binary(max_size=200) | json_values().map(encode))
    headers = st.dictionaries(st.sampled_from(["x-request-id", "x-session-id", "x-tenant-id"]),
                              st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=20),
                              max_size=2)
    return st.tuples(st.one_of(as_json, as_json, as_json, raw), headers).map(lambda t: (t[0][0], t[0][1], t[1]))


def encode(body: Any) -> bytes:
    """JSON bytes of a drawn body (``ensure_ascii`` off: the server must take raw UTF-8 too)."""
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def assert_openai_error(status: int, content: bytes) -> None:
    assert status != 200, status
    try:
        body = json.loads(content)
    except ValueError:
        raise AssertionError(f"{status} with a non-JSON body: {content[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict), f"{status} without an 'error' object: {content[:200]!r}"
    assert isinstance(err.get("message"), str) and err["message"], f"{status} without a message: {err}"
    assert isinstance(err.get("type"), str) and err["type"], f"{status} without a type: {err}"
    assert "code" in err, f"{status} without a code: {err}"
