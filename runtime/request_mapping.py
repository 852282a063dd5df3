"""OpenAI request -> what the engine takes: prompt token ids (tokenized as the engine does; the chat template for chat)
and ``SamplingParams``, checked by ``validation.check_request`` exactly as the engine will check them, so that a bad
request is a 400 naming the field as the client spelled it, never an engine error. Also the per-request checks that
need the server's view: the model name, the client's request id, and who may ask this pod to hold KV for a remote
decode.

Features hook here: a request field that changes what the engine does (``response_format``, adapters chosen by
``model``...) is mapped in ``completion_input`` / ``chat_input`` into ``EngineInput``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from jinja2 import TemplateError

from pdserve.kv_connectors import kv_auth
from pdserve.runtime.json_body import raw_body
from pdserve.runtime.protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.server_state import ServerState
from pdserve.runtime.validation import InvalidParam, check_request, check_request_id, check_token_ids


@dataclass(frozen=True)
class EngineInput:
    """One request as ``AsyncEngine.add`` takes it (the rest comes verbatim from the request body)."""

    prompt_ids: list[int]
    params: SamplingParams   # max_tokens resolved: the rest of the context when the client gave none


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise ApiError(400, f"model {model!r} not found; this server serves {state.engine.served_model_name!r}",
                       param="model", code="model_not_found")


def check_tokens(state: ServerState, ids: list[int], param: str) -> None:
    try:
        check_token_ids(ids, state.engine.limits.vocab_size, param)
    except InvalidParam as e:
        raise ApiError(400, str(e), param=param) from None


async def text_ids(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    tokenizer = state.engine.tokenizer
    return await state.off_loop(lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))


async def chat_ids(state: ServerState, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    engine = state.engine
    try:   # a template may refuse a conversation (TemplateError: e.g. roles out of order)
        return await state.off_loop(lambda: list(engine.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt)))
    except (ValueError, TypeError, TemplateError) as e:
        raise ApiError(400, f"cannot apply the chat template: {str(e)[:300]}", param="messages") from None


async def completion_input(state: ServerState, req: CompletionRequest) -> EngineInput:
    check_model(state, req.model)
    prompt = req.single_prompt()
    # a string is tokenized as the engine does (no special tokens added)
    ids = await text_ids(state, prompt, False) if isinstance(prompt, str) else list(prompt)
    return checked(state, req, ids)


async def chat_input(state: ServerState, req: ChatCompletionRequest) -> EngineInput:
    check_model(state, req.model)
    return checked(state, req, await chat_ids(state, req.message_dicts(), req.add_generation_prompt))


def checked(state: ServerState, req: SamplingRequest, prompt_ids: list[int]) -> EngineInput:
    """Prompt ids after ``truncate_prompt_tokens`` and sampling params with the effective ``max_tokens``, checked by
    ``validation.check_request`` as the engine will check them (a 400 naming the request's field)."""
    if req.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-req.truncate_prompt_tokens:]
    params = req.sampling_params(req.token_limit())
    try:
        max_tokens = check_request(prompt_ids, params, state.engine.limits, priority=req.priority)
    except InvalidParam as e:
        raise req.api_error(e) from None
    if params.max_tokens != max_tokens:
        params = replace(params, max_tokens=max_tokens)
    return EngineInput(prompt_ids, params)


def request_ids(request: Request, state: ServerState, body_id: str | None) -> tuple[str, str]:
    """(client-visible id, engine id): the engine id gets a suffix if a client reuses an id still in flight."""
    base = body_id or request.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        check_request_id(base)   # the body's id was checked by parse; a header's is echoed back in one
    except InvalidParam as e:
        raise ApiError(400, f"X-Request-Id header: {e}", param="request_id") from None
    rid = base
    while state.async_engine.is_inflight(rid):
        rid = f"{base}-{uuid.uuid4().hex[:8]}"
    return base, rid


def check_kv_handoff(request: Request, state: ServerState, params: Any) -> None:
    """403 unless a request asking this pod to hold its blocks for a remote decode comes from the deployment's router
    (its KV-secret handoff header) or carries the pod's API key (checked by the routes' guard); see
    kv_connectors/kv_auth.py."""
    if state.engine.config.kv_transfer.connector is None or not kv_auth.wants_handoff(params):
        return
    denial = kv_auth.handoff_denial(state.kv_handoff_secret, request.headers.get(kv_auth.HANDOFF_HEADER),
                                    raw_body(request), api_key_ok=bool(state.options.api_key))
    if denial:
        state.metrics.kv_handoff_rejected()
        raise ApiError(403, denial, param="kv_transfer_params", code="kv_handoff_unauthorized")
