"""The deployment's KV secret and what it authenticates on the HTTP side of the KV path (torch-free; the router uses it).

Every pod and router of one deployment shares one secret (``PDSERVE_KV_TOKEN``, or a connector's ``token`` config;
``pdserve up`` and the operator generate it). It proves three things:

* **Signed ``kv_transfer_params``.** A prefill signs the whole parameter set it returns (remote host, port, engine id,
  block ids, hashes, checksums, lease, expiry, every other field) as one extra field, ``pdserve_signature``:
  ``v1:`` + hex HMAC-SHA256 over the canonical JSON of the other fields (sorted keys, no spaces, ASCII; integral floats
  are written as integers so a router that re-encodes ``30`` as ``30.0`` does not break it). Routers that copy the
  params verbatim (pdserve's, vllm-router's ``--vllm-pd-disaggregation``) keep working. A decode pod checks signature
  and ``expires_at`` (unix seconds) *before* any connection or store lookup; params that fail are ignored (the prompt is
  computed locally, so the answer stays right) and counted as ``kv_params_rejected{reason=...}``.
* **Handoff requests.** A request asking a prefill pod to hold blocks (``do_remote_decode``) must carry
  ``X-PDServe-KV-Handoff: v1:<unix ts>:<hex HMAC(secret, ts, sha256(body))>`` (the pdserve router adds it), or be
  authenticated by the pod's API key; otherwise the pod answers 403 (no client can pin a prefill pod's blocks).
* The side channel (:mod:`side_channel`) uses the same secret for its mutual challenge-response.

Without a secret, a connector refuses to start unless configured ``insecure: true`` (``pdserve serve --kv-insecure``):
then params are neither signed nor checked, and handoffs are not authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from typing import Any, Mapping

from pdserve.runtime import envs

SIGNATURE_FIELD = "pdserve_signature"
EXPIRES_FIELD = "expires_at"
HANDOFF_HEADER = "x-pdserve-kv-handoff"
CLOCK_SKEW_S = 5            # tolerated wall-clock difference between pods
HANDOFF_WINDOW_S = 60       # a handoff header older (or newer) than this is refused
REJECT_REASONS = ("unsigned", "bad_signature", "expired", "malformed", "lora_mismatch")
_PARAMS_LABEL = b"pdserve-kv-params-v1\n"
_HANDOFF_LABEL = b"pdserve-kv-handoff-v1\n"


class MissingSecret(ValueError):
    """A KV connector was configured without the deployment's secret (and not explicitly insecure)."""


def resolve_secret(config: Mapping[str, Any]) -> bytes | None:
    """The connector config's ``token``, else PDSERVE_KV_TOKEN; None when neither is set."""
    token = config.get("token") or envs.kv_transfer_token()
    return str(token).encode() if token else None


def require_secret(name: str, config: Mapping[str, Any]) -> bytes | None:
    """The secret, or None when ``insecure`` is set; raises MissingSecret when neither."""
    secret = resolve_secret(config)
    if secret is None and not config.get("insecure"):
        raise MissingSecret(
            f"KV connector {name!r} needs the deployment's shared KV secret: set PDSERVE_KV_TOKEN (the same value in "
            "every prefill, decode and router process; `pdserve up` and the operator generate one) or the connector's "
            "'token' config. To run without authentication anyway (anyone who can reach the pod can then read or "
            "poison KV), pass --kv-insecure.")
    return secret


def _canon_value(v: Any) -> Any:
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise ValueError("non-integral number")
        return int(v)
    if isinstance(v, dict):
        return {str(k): _canon_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon_value(x) for x in v]
    return v


def canonical(params: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: every field but the signature, canonical JSON."""
    body = {k: v for k, v in params.items() if k != SIGNATURE_FIELD}
    return json.dumps(_canon_value(body), sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def _params_mac(secret: bytes, params: Mapping[str, Any]) -> str:
    return "v1:" + hmac.new(secret, _PARAMS_LABEL + canonical(params), hashlib.sha256).hexdigest()


def sign_params(params: dict[str, Any], secret: bytes | None, ttl_s: float, now: float | None = None) -> dict[str, Any]:
    """``params`` plus ``expires_at`` (now + ttl, whole seconds) and the signature; unchanged without a secret."""
    if secret is None:
        return params
    out = {**params, EXPIRES_FIELD: int(math.ceil((time.time() if now is None else now) + ttl_s))}
    out[SIGNATURE_FIELD] = _params_mac(secret, out)
    return out


def verify_params(params: Any, secret: bytes, now: float | None = None) -> str | None:
    """None when ``params`` were signed with ``secret`` and have not expired, else the rejection reason."""
    if not isinstance(params, dict):
        return "malformed"
    sig = params.get(SIGNATURE_FIELD)
    if sig is None:
        return "unsigned"
    try:
        good = isinstance(sig, str) and hmac.compare_digest(sig.encode(), _params_mac(secret, params).encode())
    except (ValueError, TypeError):   # unencodable values (NaN, fractional numbers, odd types)
        return "malformed"
    if not good:
        return "bad_signature"
    expires = params.get(EXPIRES_FIELD)
    if not isinstance(expires, (int, float)) or isinstance(expires, bool):
        return "malformed"
    if (time.time() if now is None else now) > expires + CLOCK_SKEW_S:
        return "expired"
    return None


def handoff_header(secret: bytes, body: bytes, now: float | None = None) -> str:
    """The value of ``X-PDServe-KV-Handoff`` for a request whose exact body bytes are ``body``."""
    ts = str(int(time.time() if now is None else now))
    mac = hmac.new(secret, _HANDOFF_LABEL + ts.encode() + b"\n" + hashlib.sha256(body).digest(), hashlib.sha256)
    return f"v1:{ts}:{mac.hexdigest()}"


def check_handoff_header(secret: bytes, value: str | None, body: bytes, now: float | None = None) -> bool:
    """Whether ``value`` is a fresh handoff header made with ``secret`` for exactly ``body``."""
    if not value:
        return False
    parts = value.split(":")
    if len(parts) != 3 or parts[0] != "v1" or not parts[1].isdigit():
        return False
    if abs((time.time() if now is None else now) - int(parts[1])) > HANDOFF_WINDOW_S:
        return False
    want = handoff_header(secret, body, now=int(parts[1]))
    return hmac.compare_digest(value.encode(), want.encode())


def handoff_denial(secret: bytes | None, header: str | None, body: bytes, *, api_key_ok: bool) -> str | None:
    """None when a handoff request may be honoured (insecure mode, the pod's API key, or a valid handoff header for
    exactly ``body``), else the reason to refuse it."""
    if secret is None or api_key_ok or check_handoff_header(secret, header, body):
        return None
    return ("kv_transfer_params.do_remote_decode (holding KV blocks for a remote decode) is honoured only for the "
            "deployment's router: send the X-PDServe-KV-Handoff header made with the KV secret, or run the pod with "
            "--api-key and send that key")


def lora_identity(request: Any) -> dict[str, Any]:
    """The adapter fields a prefill puts in the params it signs: the decode side must run the same weights."""
    return {"lora_name": getattr(request, "lora_name", None), "lora_digest": getattr(request, "lora_digest", None)}


def lora_mismatch(params: dict[str, Any], request: Any) -> bool:
    """Whether verified ``params`` were produced under another adapter (or the base model) than ``request`` runs:
    their KV must never be loaded (the block hashes differ too, since they chain the digest; this names the cause)."""
    return params.get("lora_digest") != getattr(request, "lora_digest", None)


def wants_handoff(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this pod to hold its blocks for a remote decode."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))
