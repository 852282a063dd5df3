"""Hypothesis strategies for what clients send the router: OpenAI completion and chat bodies, mostly well-formed with
hostile values in the fields the router itself reads (``prompt``, ``messages``, ``stream``, ``request_id``,
``cache_salt``, ``kv_transfer_params``, ``add_generation_prompt``, ``max_tokens``), plus headers, raw non-JSON and
deeply nested bodies. Router-focused; the server's own field fuzzing lives with the server tests."""

from __future__ import annotations

import json

from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"

_odd_text = st.sampled_from(["", " ", "\r\n", "x\r\ny", "\x00", "caf\u00e9", "\u65e5\u672c\u8a9e", "\ud83c\udf75",
                             "<|im_start|>", "<|im_end|>system", "{{ raise }}", "{% for %}", "\\u0000", "a" * 300])
text = st.one_of(st.text(max_size=40), _odd_text)
junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                              text),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
                    max_leaves=8)


def maybe(value_st):
    """Usually a plausible value, sometimes anything."""
    return st.one_of(value_st, value_st, value_st, junk)


_content = maybe(st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                          max_size=3)))
_message = maybe(st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "assistant", "tool"])),
                                        "content": _content}))
_kv_params = st.one_of(st.fixed_dictionaries({"do_remote_prefill": st.booleans(), "do_remote_decode": st.booleans(),
                                              "remote_host": st.sampled_from(["127.0.0.1", "10.9.9.9", "::1"]),
                                              "remote_port": st.integers(-1, 70000),
                                              "remote_block_ids": st.lists(st.integers(-5, 10**9), max_size=3)}),
                       junk)
_request_id = st.one_of(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1,
                                 max_size=20), _odd_text, junk)

_common = {
    "model": maybe(st.just(MODEL)),
    "temperature": maybe(st.sampled_from([0, 0.0, 1.0])),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "request_id": _request_id,
    "cache_salt": maybe(text),
    "kv_transfer_params": _kv_params,
    "n": maybe(st.integers(1, 2)),
    "stop": maybe(st.lists(text, max_size=2)),
}


def _body(required: dict) -> st.SearchStrategy[dict]:
    # max_tokens is always there (valid or not) so that a real pod's work per example stays small
    return st.fixed_dictionaries({**required, "max_tokens": maybe(st.integers(1, 4))},
                                 optional={**_common, "extra_field": junk})


completion_body = _body({"prompt": maybe(st.one_of(text, st.lists(st.integers(0, 49151), min_size=1, max_size=8),
                                                   st.lists(text, min_size=1, max_size=2)))})
chat_body = _body({"messages": maybe(st.lists(_message, min_size=1, max_size=3)),
                   "add_generation_prompt": maybe(st.booleans())})

# (path, raw body bytes, extra headers)
_headers = st.dictionaries(st.sampled_from(["x-request-id", "x-session-id", "x-tenant-id"]),
                           st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff), max_size=20),
                           max_size=2)
_raw_json = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_body.map(lambda b: json.dumps(b).encode())),
    st.tuples(st.just("/v1/chat/completions"), chat_body.map(lambda b: json.dumps(b).encode())),
)
_raw_bad = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.one_of(
    st.binary(max_size=200), st.integers(1, 200_000).map(lambda n: b"[" * n),
    st.integers(1, 5000).map(lambda n: b'{"prompt": ' + b"{\"a\": " * n + b"1" + b"}" * n + b"}"),
    junk.map(lambda j: json.dumps(j).encode())))
router_request = st.tuples(st.one_of(_raw_json, _raw_json, _raw_json, _raw_bad), _headers).map(
    lambda t: (t[0][0], t[0][1], t[1]))
