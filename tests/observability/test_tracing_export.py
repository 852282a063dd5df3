"""The export path in-process, against collectors that misbehave: over gRPC to a collector that accepts TCP
connections but never speaks HTTP/2, spans keep being created while the one export call hangs (they are dropped and
counted instead of waited for), the failure is counted once the call times out, and shutdown is bounded."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve import tracing
from pdserve.runtime.metrics import parse_samples
from tests.support.deps import require

require("opentelemetry.exporter.otlp.proto.grpc", "the tracing extra is not installed")


@pytest.fixture
def hung_collector():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)          # the kernel completes handshakes; nobody ever reads or answers
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_hung_grpc_collector_drops_spans_instead_of_blocking(hung_collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3")
    before = tracing.stats()
    assert not tracing.enabled() and tracing.router_span({}, "/x", "r") is tracing.router_span({}, "/y", "s")
    assert tracing.configure(hung_collector, "pdserve-test")
    try:
        headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        for i in range(200):
            with tracing.router_span(headers, "/v1/completions", f"r{i}"):
                tracing.annotate(pdserve__router__outcome="ok")
                out: dict[str, str] = {}
                tracing.inject(out)
                assert out["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
            if i == 0:
                time.sleep(0.2)   # let the export thread pick up the first batch and hang on it
        s = tracing.stats()
        # All 200 spans ended while the first export call still hangs: none finished, most were dropped.
        assert s["exported"] == before["exported"] and s["failed"] == before["failed"], s
        assert s["dropped"] - before["dropped"] >= 200 - 8, s

        deadline = time.monotonic() + 30
        while tracing.stats()["failed"] == before["failed"]:
            assert time.monotonic() < deadline, "the hung export never timed out"
            time.sleep(0.1)
        registry = CollectorRegistry()
        registry.register(tracing.MetricsCollector())
        samples = parse_samples(generate_latest(registry).decode())
        assert samples["pdserve_tracing_spans_dropped_total"] >= 192
        assert samples["pdserve_tracing_spans_failed_total"] >= 1
    finally:
        t0 = threading.Event()
        done = threading.Thread(target=lambda: (tracing.shutdown(timeout_s=3.0), t0.set()))
        done.start()
        done.join(10)
        assert t0.is_set() and not tracing.enabled()
