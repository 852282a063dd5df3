"""Router configuration: one frozen dataclass built from the CLI (``pdserve router``) or by tests directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["both", "prefill", "decode"]
Policy = Literal["precise-prefix", "round-robin", "least-loaded", "session-affinity"]
POLICIES: tuple[str, ...] = ("precise-prefix", "round-robin", "least-loaded", "session-affinity")


@dataclass(frozen=True)
class KVEventSource:
    """Where one pod publishes its KV events (ZMQ PUB) and answers replays (ZMQ ROUTER)."""

    endpoint: str                 # tcp://host:port
    replay_endpoint: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Endpoint sources: static URLs (workers are role "both") or Kubernetes discovery by label selector.
    workers: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    discover: str | None = None              # label selector, e.g. "app=pdserve,pdserve.dev/model=smol"
    namespace: str | None = None             # None -> the pod's own namespace, else "default"
    role_label: str = "pdserve.dev/role"
    pod_port: int = 8000                     # HTTP port of discovered pods (a container port named "http" wins)
    policy: Policy = "precise-prefix"
    # P/D: disaggregate only when the decode pod lacks more than this many prompt tokens (vllm-router bypasses at 256).
    pd_threshold: int = 256
    prefill_failure: Literal["retry-then-decode", "fail"] = "retry-then-decode"
    prefill_attempts: int = 2                # prefill pods tried before falling back / failing
    prefill_max_waiting: int = 64            # a prefill pod with more queued requests counts as overloaded
    api_key: str | None = None
    tokenizer: str | None = None             # None -> the default model's tokenizer (if it can be found)
    block_size: int = 16                     # must equal the pods' KV block size or no hash ever matches
    kv_events_port: int | None = None        # per-pod KV event port (discovered/static pods on their own host)
    kv_events_replay_port: int | None = None
    kv_event_sources: dict[str, KVEventSource] = field(default_factory=dict)  # explicit per-URL override
    speculative_ttl: float = 2.0             # seconds a just-routed request's blocks count as cached on its pod
    max_concurrency: int = 1024              # requests in flight in the router; beyond -> 429 + Retry-After
    max_body_bytes: int = 16 * 1024 * 1024   # larger bodies -> 413
    request_timeout: float = 600.0           # whole upstream request, first byte to last
    connect_timeout: float = 5.0
    health_interval: float = 2.0             # active /health + /metrics scrape period per pod
    health_timeout: float = 2.0
    max_retries: int = 2                     # extra attempts on another pod, before the first byte reaches the client
    retry_backoff: float = 0.01              # seconds, doubled per attempt (with jitter)
    cb_failure_threshold: int = 5            # consecutive failures that open a pod's circuit breaker
    cb_open_seconds: float = 30.0            # open -> half-open after this long
    balance_abs_threshold: float = 16.0      # load guard: SGLang-style imbalance rule, absolute part
    balance_rel_threshold: float = 1.5       # ... and relative part
    session_header: str = "x-session-id"
    weights: dict[str, float] = field(default_factory=dict)  # scorer name -> weight override
    # KV path security (router/pd.py): clients' kv_transfer_params are dropped unless the client is a trusted router;
    # handoffs to prefill pods are signed with the deployment's KV secret (None: PDSERVE_KV_TOKEN).
    trust_client_kv_params: bool = False
    kv_token: str | None = None
