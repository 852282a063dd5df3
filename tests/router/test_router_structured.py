"""The router passes structured-output and tool fields through unchanged to both halves of a P/D handoff (fake pods
on loopback record what they receive): the decode pod gets the grammar, so it constrains from its first token."""

from __future__ import annotations

import httpx

from pdserve.router.config import RouterConfig

LONG = "The quick brown fox jumps over the lazy dog. " * 40   # over the P/D threshold

FIELDS = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    "structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
    "parallel_tool_calls": False,
}


def test_pd_handoff_keeps_structured_fields(pods, make_router, tokenizer):
    (prefill, ps), (decode, ds) = pods[0], pods[1]
    _, r = make_router(RouterConfig(prefill=(ps.url,), decode=(ds.url,), pd_threshold=16, policy="round-robin"),
                       tokenizer=tokenizer)
    messages = [{"role": "user", "content": LONG},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    body = {"model": "fake", "messages": messages, "max_tokens": 7, **FIELDS}
    with httpx.Client(base_url=r.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    (p_req,), (d_req,) = prefill.state.requests, decode.state.requests
    for sent in (p_req["body"], d_req["body"]):
        assert {k: sent[k] for k in FIELDS} == FIELDS and sent["messages"] == messages
