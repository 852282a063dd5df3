"""The router's Prometheus metrics, in a registry owned by one app instance (several routers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve import tracing

MAX_MEMO = 4096  # memoized metric children
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        r.register(tracing.MetricsCollector())
        self.requests = Counter("pdserve_router_requests", "Requests answered, by outcome "
                                "(ok, upstream_error, no_endpoint, rejected, unauthorized, bad_request, "
                                "too_large, cancelled, timeout).", ["outcome"], registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Requests being handled now.", registry=r)
        self.decisions = Counter("pdserve_router_routing_decisions", "Pods chosen, by role and pod.",
                                 ["role", "endpoint"], registry=r)
        self.scores = Histogram("pdserve_router_winning_score", "Weighted score of the chosen pod.", ["role"],
                                buckets=(0, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12), registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of routed requests.", registry=r)
        self.prefix_hit_tokens = Counter("pdserve_router_prefix_hit_tokens",
                                         "Prompt tokens the chosen decode pod already held (by the router's index).",
                                         registry=r)
        self.pd_decisions = Counter("pdserve_router_pd_decisions", "Disaggregate (prefill then decode) or not.",
                                    ["decision"], registry=r)  # disaggregated | local_short | local_no_prefill
        self.pd_fallbacks = Counter("pdserve_router_pd_fallbacks", "Prefill failures, by what happened next.",
                                    ["action"], registry=r)   # retry_prefill | decode_only | fail
        self.retries = Counter("pdserve_router_retries", "Upstream attempts repeated on another pod.", ["role"],
                               registry=r)
        self.upstream_errors = Counter("pdserve_router_upstream_errors", "Failed upstream attempts.",
                                       ["role", "kind"], registry=r)
        self.ttfb = Histogram("pdserve_router_upstream_first_byte_seconds", "Upstream time to response headers.",
                              ["role"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_latency = Histogram("pdserve_router_upstream_duration_seconds",
                                          "Upstream request duration, first byte sent to last byte received.",
                                          ["role"], buckets=LATENCY_BUCKETS, registry=r)
        self.endpoints = Gauge("pdserve_router_endpoints", "Known pods, by role and state.", ["role", "state"],
                               registry=r)
        self.kv_event_batches = Counter("pdserve_router_kv_event_batches", "KV event batches applied to the index.",
                                        ["source"], registry=r)  # live | replay
        self.hit_ratio = Gauge("pdserve_router_prefix_hit_ratio", "prefix_hit_tokens / prompt_tokens so far.",
                               registry=r)
        self.index_blocks = Gauge("pdserve_router_prefix_index_blocks", "Distinct block hashes in the index.",
                                  registry=r)
        self._children: dict[tuple, object] = {}
        # Label sets known up front exist from start, so rate() and the alerts see 0 rather than nothing.
        for outcome in ("ok", "upstream_error", "no_endpoint", "rejected", "bad_request", "timeout"):
            self.requests.labels(outcome)
        for action in ("retry_prefill", "decode_only", "fail"):
            self.pd_fallbacks.labels(action)
        for role in ("prefill", "decode"):
            self.retries.labels(role)
            for kind in ("connect", "timeout"):
                self.upstream_errors.labels(role, kind)

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, memoized (the hot path pays a dict lookup, not prometheus' locking). The memo
        is bounded: label sets include pod URLs, and pods come and go for as long as the router runs."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            if len(self._children) >= MAX_MEMO:
                self._children.clear()
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget_endpoint(self, url: str) -> None:
        """Drop a removed pod's label sets (from the memo and from the exported metrics)."""
        for key in [k for k in self._children if url in k[1]]:
            del self._children[key]
        for role in ("decode", "prefill"):
            try:
                self.decisions.remove(role, url)
            except KeyError:
                pass

    def prefix_hit_ratio(self) -> float:
        total = self.prompt_tokens._value.get()
        return self.prefix_hit_tokens._value.get() / total if total else 0.0

    def render(self) -> bytes:
        self.hit_ratio.set(self.prefix_hit_ratio())
        return generate_latest(self.registry)
