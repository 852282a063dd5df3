"""``pdserve router``: flags -> RouterConfig -> RouterApp served by ``router.http_server`` (on uvloop when installed)."""

from __future__ import annotations

import argparse
import logging

from pdserve import tracing
from pdserve.runtime import envs
from pdserve.router.config import POLICIES, KVEventSource, RouterConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="run the prefix- and load-aware OpenAI proxy (prefill -> decode)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port of the OpenAI endpoint")
    src = p.add_argument_group("endpoints (one source)")
    src.add_argument("--worker", action="append", default=[], metavar="URL", help="a pod serving both roles")
    src.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill pod")
    src.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode pod")
    src.add_argument("--discover", metavar="SELECTOR", help="Kubernetes label selector of the pods to route to")
    src.add_argument("--namespace", help="namespace for --discover (default: the router pod's own, else default)")
    src.add_argument("--role-label", default="pdserve.dev/role", help="pod label holding prefill|decode|both")
    src.add_argument("--pod-port", type=int, default=8000, help="discovered pods' HTTP port (a port named http wins)")
    p.add_argument("--policy", choices=POLICIES, default="precise-prefix",
                   help="how pods are picked: longest cached prefix from KV events with load balancing, or a baseline")
    p.add_argument("--pd-threshold", type=int, default=256, metavar="TOKENS",
                   help="disaggregate only when the decode pod lacks more prompt tokens than this")
    p.add_argument("--prefill-failure", choices=("retry-then-decode", "fail"), default="retry-then-decode",
                   help="when prefill fails: retry another prefill pod, then send the whole request to decode; or fail")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--upstream-api-key", default=None,
                   help="key sent to the pods (started with --api-key) on every request, health check and scrape "
                        "(default: env PDSERVE_UPSTREAM_API_KEY, which keeps it off the command line)")
    p.add_argument("--cache-salt-from", choices=("client", "api-key", "header"), default="client",
                   help="who sets cache_salt: the client as sent, or the router from the tenant's API key or "
                        "--tenant-header (HMAC with --cache-salt-secret; isolates tenants' prefix caches)")
    p.add_argument("--tenant-header", default="x-tenant-id",
                   help="header with the tenant identity an authenticating gateway sets (--cache-salt-from header)")
    p.add_argument("--cache-salt-secret", default=None,
                   help="HMAC key for derived salts, the same on every router replica "
                        "(default: env PDSERVE_CACHE_SALT_SECRET, else random per process)")
    p.add_argument("--token-cache-bytes", type=int, default=64 * 1024 * 1024,
                   help="bound of the router's tokenizer cache (estimated bytes)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer dir (default: the default model's)")
    p.add_argument("--block-size", type=int, default=16, help="the pods' KV block size")
    p.add_argument("--kv-events-port", type=int, help="pods' KV event PUB port (on each pod's host)")
    p.add_argument("--kv-events-replay-port", type=int, help="pods' KV event replay port")
    p.add_argument("--kv-events-source", action="append", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                   help="explicit KV event endpoints of one pod, e.g. http://h:8000=tcp://h:5557,tcp://h:5558")
    p.add_argument("--max-concurrency", type=int, default=1024,
                   help="requests in flight through the router; beyond it clients get 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="larger request bodies get 413")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="upstream request timeout")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="S", help="upstream connect timeout")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                   help="period of active /health checks and /metrics load scrapes")
    p.add_argument("--max-retries", type=int, default=2,
                   help="retries on another pod, only before the first byte reaches the client")
    p.add_argument("--cb-failure-threshold", type=int, default=5,
                   help="consecutive failures that open a pod's circuit breaker")
    p.add_argument("--cb-open-seconds", type=float, default=30.0,
                   help="seconds an open breaker waits before letting one probe request through")
    p.add_argument("--balance-abs-threshold", type=float, default=16.0,
                   help="load guard: ignore cache affinity when max - min pod load exceeds this")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="load guard: ... and max load exceeds this multiple of min load")
    p.add_argument("--trust-client-kv-params", action="store_true",
                   help="forward clients' kv_transfer_params (only when every client is itself a trusted router; "
                        "by default they are dropped)")
    p.add_argument("--log-level", default="warning", help="debug|info|warning|error")
    tracing.add_flag(p)
    p.set_defaults(func=run)
    return p


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    if not (a.worker or a.decode or a.discover):
        raise SystemExit("pdserve router: give --worker URL..., --prefill/--decode URL..., or --discover SELECTOR")
    if a.prefill and not a.decode and not a.worker and not a.discover:
        raise SystemExit("pdserve router: --prefill needs at least one --decode")
    sources = {}
    for item in a.kv_events_source:
        url, _, eps = item.partition("=")
        pub, _, replay = eps.partition(",")
        if not url or not pub:
            raise SystemExit(f"pdserve router: bad --kv-events-source {item!r}")
        sources[url.rstrip("/")] = KVEventSource(pub, replay or None)
    return RouterConfig(
        upstream_api_key=a.upstream_api_key or envs.upstream_api_key(), cache_salt_from=a.cache_salt_from,
        tenant_header=a.tenant_header, cache_salt_secret=a.cache_salt_secret or envs.cache_salt_secret(),
        token_cache_bytes=a.token_cache_bytes,
        host=a.host, port=a.port, workers=tuple(a.worker), prefill=tuple(a.prefill), decode=tuple(a.decode),
        discover=a.discover, namespace=a.namespace, role_label=a.role_label, pod_port=a.pod_port, policy=a.policy,
        pd_threshold=a.pd_threshold, prefill_failure=a.prefill_failure, api_key=a.api_key, tokenizer=a.tokenizer,
        block_size=a.block_size, kv_events_port=a.kv_events_port, kv_events_replay_port=a.kv_events_replay_port,
        kv_event_sources=sources, max_concurrency=a.max_concurrency, max_body_bytes=a.max_body_bytes,
        request_timeout=a.request_timeout, connect_timeout=a.connect_timeout, health_interval=a.health_interval,
        max_retries=a.max_retries, cb_failure_threshold=a.cb_failure_threshold, cb_open_seconds=a.cb_open_seconds,
        balance_abs_threshold=a.balance_abs_threshold, balance_rel_threshold=a.balance_rel_threshold,
        trust_client_kv_params=a.trust_client_kv_params)


def run(a: argparse.Namespace) -> int:
    from pdserve.router import http_server
    from pdserve.router.app import RouterApp

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(a)
    tracing.configure(a.otlp_traces_endpoint, "pdserve-router")
    http_server.run(RouterApp(cfg), cfg.host, cfg.port)
    return 0
