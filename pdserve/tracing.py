"""OpenTelemetry tracing: one trace per request across router, prefill, KV transfer and decode. Off by default.

Enabled per process by ``--otlp-traces-endpoint URL`` (``pdserve serve|router|up``) or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(``http/protobuf``, the default, or ``grpc``), ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` and
``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``/``HEADERS`` are honoured as the SDK defines them. Needs the ``tracing`` extra
(``pip install 'pdserve[tracing]'``); every function here is a cheap no-op while tracing is off.

The trace of one P/D request (W3C ``traceparent`` accepted from the client and sent on to the pods)::

    client span (optional)
    └── router            routing decision and scores, P/D decision, retries (events), outcome
        ├── prefill       queue, compute, prompt and cached tokens       (prefill pod)
        └── decode        queue, TTFT, ITL, tokens                       (decode pod)
            └── kv_transfer   connector, blocks, bytes, failures, verify, recomputed tokens

Pod spans are built when the request finishes, from the engine's own timestamps (as vLLM does), so the engine thread
never touches OpenTelemetry. Export runs on the SDK's BatchSpanProcessor thread: a span that finds more than
``OTEL_BSP_MAX_QUEUE_SIZE`` spans still waiting for export is dropped and counted
(``pdserve_tracing_spans_dropped_total``), so a dead or slow collector costs a counter, never request latency.
One tracer per process (the component's): ``configure`` is called once by each CLI entry point.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

# vLLM's span attribute names (vllm/tracing.py SpanAttributes) where one exists; pdserve.* otherwise.
REQUEST_ID = "gen_ai.request.id"
RESPONSE_MODEL = "gen_ai.response.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
N = "gen_ai.request.n"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
CACHED_TOKENS = "gen_ai.usage.cached_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TTFT = "gen_ai.latency.time_to_first_token"
E2E = "gen_ai.latency.e2e"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
ITL_MEAN = "pdserve.latency.inter_token_mean"

_lock = threading.Lock()
_tracer: Any = None           # opentelemetry Tracer of this process, None while off
_provider: Any = None
_stats = {"submitted": 0, "exported": 0, "failed": 0, "dropped": 0}
_max_pending = 2048


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces to this OTLP collector, e.g. http://otel:4318/v1/traces "
                             "(gRPC with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc, e.g. http://otel:4317); default: "
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off")


def enabled() -> bool:
    return _tracer is not None


def configure(endpoint: str | None, service_name: str) -> bool:
    """Start exporting this process's spans to ``endpoint`` (else the OTEL_* environment); False when off."""
    global _tracer, _provider, _max_pending
    endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise SystemExit(f"tracing needs the OpenTelemetry SDK: pip install 'pdserve[tracing]' ({e})") from None
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "5"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=endpoint, timeout=timeout, insecure=endpoint.startswith("http://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if urlparse(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        exporter = HttpExporter(endpoint=endpoint, timeout=timeout)
    _max_pending = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048"))
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    batch = min(_max_pending, int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512")))
    provider.add_span_processor(_BoundedProcessor(BatchSpanProcessor(
        _CountingExporter(exporter), max_queue_size=_max_pending, max_export_batch_size=batch)))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    atexit.register(shutdown)
    log.info("tracing: exporting spans of %s to %s (%s)", service_name, endpoint, protocol)
    return True


def shutdown(timeout_s: float = 3.0) -> None:
    """Flush what can be flushed within ``timeout_s`` (a dead collector must not hold up the exit)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        t = threading.Thread(target=provider.shutdown, daemon=True)
        t.start()
        t.join(timeout_s)


class _CountingExporter:
    """Wraps the OTLP exporter to count what left the process and what failed (for the pending bound)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception as e:  # noqa: BLE001 - an exporter bug must not kill the export thread
            log.debug("tracing: export failed: %r", e)
            result = SpanExportResult.FAILURE
        with _lock:
            _stats["exported" if result == SpanExportResult.SUCCESS else "failed"] += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return getattr(self.inner, "force_flush", lambda *_: True)(timeout_millis)


class _BoundedProcessor:
    """In front of the BatchSpanProcessor: drops (and counts) a span when ``_max_pending`` spans still wait for export,
    whatever the SDK version does with a full queue. on_end is a counter check and a deque append: never blocks."""

    def __init__(self, inner: Any):
        self.inner = inner

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: Any) -> None:
        with _lock:
            if _stats["submitted"] - _stats["exported"] - _stats["failed"] >= _max_pending:
                _stats["dropped"] += 1
                return
            _stats["submitted"] += 1
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def stats() -> dict[str, int]:
    with _lock:
        return dict(_stats)


class MetricsCollector:
    """Prometheus collector of this process's span counters (nothing while tracing is off); register it in a
    component's registry: ``registry.register(tracing.MetricsCollector())``."""

    def collect(self) -> Iterator[Any]:
        if not enabled():
            return
        from prometheus_client.core import CounterMetricFamily

        s = stats()
        for key, doc in (("exported", "Spans the collector accepted."),
                         ("failed", "Spans whose export failed (collector down, timeout, rejected)."),
                         ("dropped", "Spans dropped before export because too many were still waiting.")):
            yield CounterMetricFamily(f"pdserve_tracing_spans_{key}", doc, value=s[key])

    def describe(self) -> list:
        return []


# ---- context propagation ------------------------------------------------------------------------------------------

def _extract(headers: Mapping[str, str]) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({k.lower(): v for k, v in headers.items()})


def inject(headers: dict[str, str]) -> None:
    """Add the current span's ``traceparent`` to outgoing ``headers`` (router -> pods)."""
    if _tracer is None:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(headers)


# ---- router -------------------------------------------------------------------------------------------------------

_NULL = nullcontext()


def router_span(headers: Mapping[str, str], path: str, request_id: str) -> Any:
    """``with tracing.router_span(...)``: the router's SERVER span of one request, current for the block (so that
    ``annotate``, ``event`` and ``inject`` reach it), child of the client's ``traceparent`` if any."""
    return _NULL if _tracer is None else _router_span(headers, path, request_id)


@contextmanager
def _router_span(headers: Mapping[str, str], path: str, request_id: str) -> Iterator[Any]:
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span("router", context=_extract(headers), kind=SpanKind.SERVER,
                                       attributes={REQUEST_ID: request_id, "http.route": path}) as span:
        yield span


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (dots spelled as ``__``: ``annotate(pdserve__pd__decision="local")``)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    for k, v in attributes.items():
        if v is not None:
            span.set_attribute(k.replace("__", "."), v)


def event(name: str, **attributes: Any) -> None:
    """Add an event (e.g. a retry) to the current span."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, {k.replace("__", "."): v for k, v in attributes.items()
                                              if v is not None})


def decision_attributes(prefix: str, decision: Any) -> dict[str, Any]:
    """A routing ``Decision`` as span attributes: the chosen pod, its total score, and every candidate's score per
    scorer (``pdserve.<prefix>.scores.<scorer>`` aligned with ``pdserve.<prefix>.candidates``); {} while off."""
    if _tracer is None or decision is None:
        return {}
    out = {f"pdserve__{prefix}__endpoint": decision.endpoint.url, f"pdserve__{prefix}__score": float(decision.score),
           f"pdserve__{prefix}__candidates": [c.url for c in decision.candidates]}
    for scorer, values in decision.scores.items():
        out[f"pdserve__{prefix}__scores__{scorer.replace('-', '_')}"] = [float(v) for v in values]
    return out


# ---- runtime pods -------------------------------------------------------------------------------------------------

def request_trace(headers: Mapping[str, str], role: str, engine: Any, request_id: str, params: Any,
                  kv_transfer_params: dict | None) -> Any:
    """Called when a pod accepts a request; returns ``on_finish(output)`` that records its spans (None when off)."""
    if _tracer is None:
        return None
    model, block_size = engine.served_model_name, engine.config.cache.block_size
    parent = _extract(headers)
    kv = kv_transfer_params or {}
    name = "prefill" if kv.get("do_remote_decode") or role == "prefill" else \
        "decode" if kv.get("do_remote_prefill") or role == "decode" else "generate"
    attrs = {REQUEST_ID: request_id, RESPONSE_MODEL: model, "pdserve.role": role, MAX_TOKENS: params.max_tokens,
             TEMPERATURE: params.temperature, TOP_P: params.top_p, N: params.n}
    if kv.get("remote_engine_id"):
        attrs["pdserve.kv.remote_engine_id"] = str(kv["remote_engine_id"])

    def on_finish(out: Any) -> None:
        try:
            _record_request(parent, name, attrs, out, block_size)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            log.exception("tracing: recording request %s failed", request_id)

    return on_finish


def _ns(t: float | None) -> int | None:
    return None if t is None else int(t * 1e9)


def _record_request(parent: Any, name: str, attrs: dict[str, Any], out: Any, block_size: int) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    now = time.time()
    m = getattr(out, "metrics", None)
    arrival = m.arrival_time if m else now
    scheduled = m.first_scheduled_time if m else None
    first = m.first_token_time if m else None
    end = (m.finished_time if m else None) or now
    outputs = list(getattr(out, "outputs", None) or [])
    n_out = sum(len(c.token_ids) for c in outputs)
    kv = (m.kv_transfer if m else None) or {}
    a = dict(attrs)
    a[PROMPT_TOKENS] = len(out.prompt_token_ids) if out is not None else 0
    a[COMPLETION_TOKENS] = n_out
    a[CACHED_TOKENS] = int(getattr(out, "num_cached_tokens", 0) or 0)
    a[FINISH_REASONS] = [c.finish_reason or "abort" for c in outputs] or ["abort"]
    a[E2E] = end - arrival
    if scheduled is not None:
        # A remote-KV load happens before the request is first scheduled: that part of the wait is the transfer.
        a[TIME_IN_QUEUE] = (kv["start"] if kv.get("start") else scheduled) - arrival
    if first is not None:
        a[TTFT] = first - arrival
        a[TIME_IN_DECODE] = end - first
        if scheduled is not None:
            a[TIME_IN_PREFILL] = first - scheduled
        if n_out > 1:
            a[ITL_MEAN] = (end - first) / (n_out - 1)
    if m is not None:
        a["pdserve.num_preemptions"] = m.num_preemptions
        a["pdserve.kv.recomputed_tokens"] = m.num_recomputed_tokens
    span = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=_ns(arrival), attributes=a)
    if any(r in ("error", "abort") for r in a[FINISH_REASONS]):
        span.set_status(Status(StatusCode.ERROR, ",".join(a[FINISH_REASONS])))
    if kv.get("start"):
        ka = {"pdserve.kv.connector": kv.get("connector", ""), "pdserve.kv.blocks": kv.get("blocks", 0),
              "pdserve.kv.bytes": kv.get("bytes", 0), "pdserve.kv.failed_blocks": kv.get("failed_blocks", 0),
              "pdserve.kv.errors": list(kv.get("errors") or []), "pdserve.kv.verified": bool(kv.get("verified")),
              "pdserve.kv.recomputed_tokens": m.num_recomputed_tokens,
              "pdserve.kv.recomputed_blocks": -(-m.num_recomputed_tokens // block_size) if block_size else 0}
        child = _tracer.start_span("kv_transfer", context=trace.set_span_in_context(span), kind=SpanKind.INTERNAL,
                                   start_time=_ns(kv["start"]), attributes=ka)
        if ka["pdserve.kv.failed_blocks"]:
            child.set_status(Status(StatusCode.ERROR, ",".join(ka["pdserve.kv.errors"])))
        child.end(end_time=_ns(kv.get("end") or kv["start"]))
    span.end(end_time=_ns(end))
