"""Prometheus metrics of one server, under vLLM's names so existing dashboards and gateways (GIE, llm-d) can scrape
pdserve pods, plus pdserve's own under ``pdserve:``.

Everything lives in a per-server ``CollectorRegistry`` (no global state). Engine-wide counters and gauges are read
from the latest ``EngineStats`` snapshot (the engine thread stores it after every step, the scrape only reads it);
per-request latencies and batch sizes are histograms observed as they happen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve import tracing

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so that dashboards' quantile queries behave the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# EngineStats field -> (metric name, help); counters get "_total" appended on exposition
_STAT_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."),
}
_STAT_COUNTERS = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prompt_tokens": ("vllm:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Generated tokens."),
    "num_preemptions": ("vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "kv_load_failures": ("pdserve:kv_load_failures", "Remote KV blocks that failed to load."),
    "recomputed_tokens": ("pdserve:recomputed_tokens", "Tokens recomputed after a failed KV load."),
}


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: Any = None  # latest EngineStats, replaced wholesale by the engine thread

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for field, (name, doc) in _STAT_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, field, 0) or 0))
            yield g
        for field, (name, doc) in _STAT_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, field, 0) or 0))
            yield c


class _ConnectorCollector(Collector):
    """The KV connector's counters (``connector.metrics()``: ``kv_<name>{label=value,...} -> value``) as
    ``pdserve:kv_connector_<name>``; names ending in ``_active`` are gauges, the rest counters."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.values: dict[str, float] = {}  # replaced wholesale by the engine thread
        self.connector: str | None = None   # its registry name, exported as pdserve:kv_connector_info{connector}

    def collect(self) -> Iterator[Metric]:
        if self.connector:   # joined by dashboards (``* on (pod) group_left (connector)``) to break down per connector
            info = GaugeMetricFamily("pdserve:kv_connector_info", "The pod's KV connector (value 1).",
                                     labels=["model_name", "connector"])
            info.add_metric([self.model_name, self.connector], 1.0)
            yield info
        families: dict[str, Metric] = {}
        for key, value in sorted(self.values.items()):
            name, _, rest = key.partition("{")
            labels = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if "=" in kv)
            family = families.get(name)
            if family is None:
                kind = GaugeMetricFamily if name.endswith("_active") else CounterMetricFamily
                family = families[name] = kind(f"pdserve:kv_connector_{name.removeprefix('kv_')}", f"KV connector: {name}.",
                                               labels=["model_name", *labels])
            family.add_metric([self.model_name, *labels.values()], float(value))
        yield from families.values()


class ServerMetrics:
    """All metrics of one server. Thread-safe: prometheus_client metrics lock internally."""

    def __init__(self, model_name: str, *, kv_connector: bool = False):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._stats = _EngineStatsCollector(model_name)
        self.registry.register(self._stats)
        self._connector = _ConnectorCollector(model_name)
        self.registry.register(self._connector)
        self.registry.register(tracing.MetricsCollector())
        m, r = ["model_name"], self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.batch_size = Histogram("pdserve:batch_size", "Requests advanced by one engine step.", m,
                                    buckets=BATCH_BUCKETS, registry=r).labels(model_name)
        self.max_batch_size = Gauge("pdserve:max_batch_size", "Largest number of requests in one engine step so far.",
                                    m, registry=r).labels(model_name)
        self.num_steps = Counter("pdserve:engine_steps", "Engine steps run.", m, registry=r).labels(model_name)
        self._rejected = Counter("pdserve:requests_rejected", "Requests refused before reaching the engine.",
                                 ["model_name", "reason"], registry=r)
        self.aborted_disconnect = Counter("pdserve:requests_aborted_on_disconnect",
                                          "Requests aborted because the client went away.", m,
                                          registry=r).labels(model_name)
        self.kv_event_batches = Counter("pdserve:kv_event_batches_published", "KV event batches published.", m,
                                        registry=r).labels(model_name)
        self.model_weight_bytes = Gauge("pdserve:model_weight_bytes",
                                        "Bytes the model weights occupy (quantized codes and scales included).", m,
                                        registry=r).labels(model_name)
        # Counted by the server (it answers the 403), exported beside the connector's own counters.
        self._handoffs_rejected = Counter("pdserve:kv_connector_handoffs_rejected",
                                          "Requests refused for asking to hold KV for a remote decode without the "
                                          "router's handoff header or the API key.", m,
                                          registry=r).labels(model_name) if kv_connector else None
        self._max_batch = 0
        for reason in ("queue_full", "draining"):   # exist from start: rate() and alerts see 0, not nothing
            self._rejected.labels(model_name, reason)

    def set_model_weight_bytes(self, nbytes: int) -> None:
        """Set once at start-up from ``LoadedModel.weight_bytes`` (what the weights really take, quantized or not)."""
        self.model_weight_bytes.set(nbytes)

    def set_engine_stats(self, stats: Any) -> None:
        self._stats.stats = stats

    def set_connector_metrics(self, values: dict[str, float], connector: str | None = None) -> None:
        self._connector.values = dict(values)
        self._connector.connector = connector

    def observe_step(self, batch_size: int) -> None:
        self.num_steps.inc()
        if batch_size > 0:
            self.batch_size.observe(batch_size)
            if batch_size > self._max_batch:
                self._max_batch = batch_size
                self.max_batch_size.set(batch_size)

    def request_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def kv_handoff_rejected(self) -> None:
        if self._handoffs_rejected is not None:
            self._handoffs_rejected.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latencies of one request: TTFT, inter-token latency (per token), end-to-end; fed with each
    cumulative output as it arrives (``None``: aborted by the server)."""

    def __init__(self, metrics: ServerMetrics, arrival: float, on_finish: Callable[[Any], None] | None = None):
        self.metrics, self.arrival, self.last, self.num_tokens = metrics, arrival, None, 0
        self.on_finish = on_finish   # called once with the final output (None: aborted), e.g. by tracing

    def update(self, out: Any) -> None:
        now = time.monotonic()
        n = sum(len(c.token_ids) for c in out.outputs) if out is not None else self.num_tokens
        if n > self.num_tokens:
            if self.last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                per_token = (now - self.last) / (n - self.num_tokens)
                for _ in range(n - self.num_tokens):
                    self.metrics.itl.observe(per_token)
            self.last, self.num_tokens = now, n
        if out is None or out.finished:
            self.metrics.e2e.observe(now - self.arrival)
            reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
            self.metrics.request_finished(reason or "abort")
            if self.on_finish is not None:
                self.on_finish, on_finish = None, self.on_finish
                on_finish(out)


def parse_samples(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` from an exposition text (for tests and tools; ignores comments)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
