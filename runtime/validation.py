"""The one validation of what a request asks for: every path (HTTP server, ``LLM``, ``LLMEngine.add_request``) runs
these checks, so a value the engine cannot execute is refused before it reaches a step.

Two layers, both here:

- ``check_sampling_params``: the model-free ranges and types of ``SamplingParams`` (run by its constructor).
- ``check_request``: what needs the model and the cache (``RequestLimits``): prompt and stop token ids inside the
  vocabulary, prompt plus ``max_tokens`` within the context and the KV pool, ``priority`` within int64.

Every failure is an ``InvalidParam`` (a ``ValueError``) naming the offending field, so the server can answer a 400 whose
``param`` is that field. Ranges follow vLLM/OpenAI; integers that reach torch (seeds, ``top_k``) are bounded so that
no tensor or generator constructor can overflow (a seeded ``n > 1`` request seeds child ``i`` with ``seed + i``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16                  # completions per request (the engine fans them out sharing the prompt's blocks)
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1       # larger values mean "no top-k" anyway (the sampler caps k at the vocabulary)
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LEN = 256
# Request ids travel in the X-Request-Id header and in child ids ("<id>#<i>"): visible ASCII only, no '#'.
_REQUEST_ID = re.compile(r"[\x21\x22\x24-\x7e]{1,%d}" % MAX_REQUEST_ID_LEN)


class InvalidParam(ValueError):
    """A request field out of range; ``param`` names the field (as ``SamplingParams`` / ``add_request`` spell it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can execute (``LLMEngine.limits``)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_unchunked_prompt: int | None = None   # prompt tokens one step takes when chunked prefill is off


def _bad(param: str, why: str, value: Any) -> InvalidParam:
    shown = repr(value)
    return InvalidParam(param, f"{param} {why}, got {shown[:80] + '...' if len(shown) > 80 else shown}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))   # (math.isfinite overflows on huge ints)


def _int_in(sp: Any, name: str, lo: int | None, hi: int | None, why: str) -> None:
    v = getattr(sp, name)
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, why, v)


def _num_in(sp: Any, name: str, lo: float, hi: float, why: str, *, lo_open: bool = False) -> None:
    v = getattr(sp, name)
    if not _is_num(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _bad(name, why, v)


def check_sampling_params(sp: Any) -> None:
    """Ranges and types of one ``SamplingParams`` (everything that does not need the model)."""
    _int_in(sp, "n", 1, MAX_N, f"must be an integer in [1, {MAX_N}]")
    if sp.max_tokens is not None:
        _int_in(sp, "max_tokens", 1, None, "must be an integer >= 1")
    _int_in(sp, "min_tokens", 0, None, "must be an integer >= 0")
    if sp.max_tokens is not None and sp.min_tokens > sp.max_tokens:
        raise _bad("min_tokens", f"must be <= max_tokens ({sp.max_tokens})", sp.min_tokens)
    _num_in(sp, "temperature", 0.0, MAX_TEMPERATURE, f"must be a number in [0, {MAX_TEMPERATURE:g}]")
    _num_in(sp, "top_p", 0.0, 1.0, "must be a number in (0, 1]", lo_open=True)
    _int_in(sp, "top_k", -1, MAX_TOP_K, f"must be -1 (off), 0 (off) or an integer in [1, {MAX_TOP_K}]")
    _num_in(sp, "min_p", 0.0, 1.0, "must be a number in [0, 1]")
    if sp.seed is not None:
        _int_in(sp, "seed", INT64_MIN, INT64_MAX - (sp.n - 1),
                "must be an integer within int64" + (f" (seed + n - 1 too: n={sp.n})" if sp.n > 1 else ""))
    _num_in(sp, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY,
            f"must be a number in (0, {MAX_REPETITION_PENALTY:g}]", lo_open=True)
    _num_in(sp, "presence_penalty", -2.0, 2.0, "must be a number in [-2, 2]")
    _num_in(sp, "frequency_penalty", -2.0, 2.0, "must be a number in [-2, 2]")
    if sp.logprobs is not None:
        _int_in(sp, "logprobs", 0, MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}]")
    stops = sp.stop_strings
    if len(stops) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stops):
        raise _bad("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings", sp.stop)
    if any(not _is_int(t) or t < 0 for t in sp.stop_token_ids):
        raise _bad("stop_token_ids", "must be non-negative token ids", sp.stop_token_ids)


def check_token_ids(ids: Sequence[Any], vocab_size: int, param: str) -> None:
    if set(map(type, ids)) <= {int} and (not ids or 0 <= min(ids) and max(ids) < vocab_size):
        return   # the common case at C speed (a 1,000-token prompt: ~20 us, not ~150)
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidParam(param, f"{param}: token ids must be integers in [0, {vocab_size}), got {bad!r}")


def check_priority(priority: Any) -> None:
    if not _is_int(priority) or not INT64_MIN <= priority <= INT64_MAX:
        raise _bad("priority", "must be an integer within int64", priority)


def check_truncate_prompt_tokens(k: Any) -> None:
    if k is not None and (not _is_int(k) or k < 1):
        raise _bad("truncate_prompt_tokens", "must be an integer >= 1", k)


def check_logit_bias(bias: dict[Any, Any], vocab_size: int | None = None) -> None:
    """Keys are token ids (as OpenAI sends them: decimal strings), values in [-100, 100]."""
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19 else key
        if not _is_int(tid) or tid < 0 or (vocab_size is not None and tid >= vocab_size):
            raise _bad("logit_bias", "keys must be token ids", key)
        if not _is_num(value) or not -100 <= value <= 100:
            raise _bad("logit_bias", "values must be numbers in [-100, 100]", value)


def check_request(prompt_ids: Sequence[int], sp: Any, limits: RequestLimits, *, priority: int = 0) -> int:
    """Model-dependent checks of one request; returns its effective ``max_tokens`` (the rest of the context when
    ``sp.max_tokens`` is None)."""
    check_token_ids(prompt_ids, limits.vocab_size, "prompt")
    check_token_ids(sp.stop_token_ids, limits.vocab_size, "stop_token_ids")
    check_priority(priority)
    n, limit = len(prompt_ids), limits.max_model_len
    if not n:
        raise InvalidParam("prompt", "the prompt is empty")
    if n >= limit:
        raise InvalidParam("prompt", f"prompt has {n} tokens, the model's context length is {limit} tokens")
    max_tokens = sp.max_tokens if sp.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise InvalidParam("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                                         f"context length ({limit} tokens)")
    # An explicit max_tokens must fit the pool; an open-ended one is cut ("length") when the pool is full.
    reserve = max_tokens if sp.max_tokens is not None else 1
    need = -(-(n + reserve) // limits.block_size)
    if need > limits.num_blocks:
        raise InvalidParam("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks, "
                                         f"more than the whole cache ({limits.num_blocks} blocks)")
    if limits.max_unchunked_prompt is not None and n > limits.max_unchunked_prompt:
        raise InvalidParam("prompt", f"prompt ({n} tokens) exceeds max_num_batched_tokens "
                                     f"({limits.max_unchunked_prompt}) and chunked prefill is disabled")
    return max_tokens


def check_request_id(request_id: Any) -> str:
    """A client-chosen request id, refused unless it is 1-256 visible ASCII characters other than '#' (it is echoed in
    a response header, so CR/LF or non-latin-1 text must never get through)."""
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise _bad("request_id", f"must be 1-{MAX_REQUEST_ID_LEN} visible ASCII characters (no spaces or '#')",
                   request_id)
    return request_id
