"""Prefill/decode handoff (vLLM's ``kv_transfer_params`` protocol, so it drives pdserve and vLLM pods alike).

1. Prefill: the original body with ``max_tokens: 1`` (and ``max_completion_tokens``), ``n: 1`` (no ``best_of``: one
   copy of the prompt's KV moves once, decode samples the client's n from it), ``stream: false``, no
   ``stream_options``, and ``kv_transfer_params`` asking for a remote decode, plus the request's ``X-Request-Id``.
2. The prefill pod's JSON answer carries top-level ``kv_transfer_params`` (remote block ids, engine id, host, port).
3. Decode: the original body (stream setting and limits as the client sent them) with those params copied verbatim.

Security (kv_connectors/kv_auth.py): the prefill request carries ``X-PDServe-KV-Handoff``, an HMAC of its exact body
under the deployment's KV secret, without which prefill pods refuse to hold blocks (403); the params the prefill
returns are signed by it, and decode pods ignore any they cannot verify. ``client_body`` drops ``kv_transfer_params``
a client sent (unless ``--trust-client-kv-params``), so no client can name the address a decode pod reads KV from.

``run_prefill`` tries up to ``attempts`` distinct prefill pods; a prefill pod that errors, times out, or answers
200 without ``kv_transfer_params`` counts as a failed attempt (and a circuit-breaker failure). A client error (4xx
other than 408/429) is the request's fault, not the pod's: it is returned to the caller to relay as is.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pdserve.kv_connectors import kv_auth
from pdserve.router.config import RouterConfig
from pdserve.router.endpoints import Endpoint
from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import RETRYABLE_STATUS, Upstream, UpstreamFailure
from pdserve.runtime import envs

REMOTE_DECODE_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}


def client_body(body: dict[str, Any], raw: bytes, trusted: bool) -> tuple[dict[str, Any], bytes]:
    """(body, raw bytes) without a client's ``kv_transfer_params``, unless the client is trusted (another router)."""
    if trusted or "kv_transfer_params" not in body:
        return body, raw
    body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return body, json.dumps(body).encode()


def kv_secret(cfg: RouterConfig) -> bytes | None:
    token = cfg.kv_token or envs.kv_transfer_token()
    return token.encode() if token else None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    b = dict(body)
    # n (and best_of) only shape the decode side's sampling: the prompt's KV is computed and handed off once.
    b["n"] = 1
    b.pop("best_of", None)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    return b


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": kv_transfer_params}


class PrefillResult:
    """Either ``kv_transfer_params`` from ``endpoint``, or a client error (status, body) to relay, or neither (all
    attempts failed; ``error`` says why)."""

    __slots__ = ("endpoint", "kv_transfer_params", "client_error", "error")

    def __init__(self, endpoint: Endpoint | None = None, kv_transfer_params: dict | None = None,
                 client_error: tuple[int, bytes] | None = None, error: str = ""):
        self.endpoint, self.kv_transfer_params, self.client_error, self.error = (
            endpoint, kv_transfer_params, client_error, error)


async def run_prefill(upstream: Upstream, metrics: RouterMetrics, pick: Callable[[set[str]], Endpoint | None],
                      path: str, body: dict[str, Any], headers: dict[str, str], attempts: int,
                      kv_secret: bytes | None = None) -> PrefillResult:
    payload = json.dumps(prefill_body(body)).encode()
    if kv_secret is not None:   # proves to the prefill pod that this handoff comes from the deployment's router
        headers = {**headers, kv_auth.HANDOFF_HEADER: kv_auth.handoff_header(kv_secret, payload)}
    tried: set[str] = set()
    error = "no prefill pod available"
    for i in range(attempts):
        if i:
            metrics.pd_fallbacks.labels("retry_prefill").inc()

        def pick_untried(exclude: set[str]) -> Endpoint | None:
            return pick(exclude | tried)

        try:
            att = await upstream.dispatch("prefill", pick_untried, "POST", path, payload, headers, retries=0)
        except UpstreamFailure as e:
            if not e.tried:  # nobody left to try
                return PrefillResult(error=error if tried else str(e))
            tried |= e.tried
            error = str(e)
            if e.timed_out:  # sent, maybe still computing there: another prefill would run the prompt twice
                return PrefillResult(error=error)
            continue
        ep = att.endpoint
        tried.add(ep.url)
        try:
            data = await att.resp.read()
        except Exception as e:  # noqa: BLE001 (any transport failure mid-body is a failed attempt)
            att.finish(ok=False)
            error = f"{ep.url}: prefill body: {e}"
            continue
        att.finish()
        if 400 <= att.resp.status < 500 and att.resp.status not in RETRYABLE_STATUS:
            return PrefillResult(client_error=(att.resp.status, data))
        params = None
        if att.resp.status == 200:
            try:
                params = json.loads(data).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
        if isinstance(params, dict) and params:
            return PrefillResult(endpoint=ep, kv_transfer_params=params)
        if att.resp.status == 200:  # (5xx were already counted by dispatch)
            ep.breaker.record_failure()
        error = f"{ep.url}: prefill answered HTTP {att.resp.status} without kv_transfer_params"
    return PrefillResult(error=error)
