"""Structured-output metrics on ``/metrics``: grammar compile time (histogram), compile-cache hits and misses, requests
by structured-output kind (json, json_object, regex, choice, grammar, structural_tag). Read from the manager's
cumulative ``StructuredOutputStats`` at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.runtime.structured_output.manager import COMPILE_BUCKETS, StructuredOutputStats
from pdserve.runtime.structured_output.params import KINDS


class StructuredOutputCollector(Collector):
    def __init__(self, stats: StructuredOutputStats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats, [self.model_name]
        h = HistogramMetricFamily("pdserve:grammar_compile_seconds", "Time to compile one grammar (cache misses).",
                                  labels=["model_name"])
        cumulative = list(accumulate(s.compile_buckets))
        h.add_metric(m, [(str(b), float(c)) for b, c in zip(COMPILE_BUCKETS, cumulative)]
                     + [("+Inf", float(cumulative[-1]))], s.compile_seconds_sum)
        yield h
        for name, value, doc in (("grammar_cache_hits", s.cache_hits, "Grammar compiles served from the cache."),
                                 ("grammar_cache_misses", s.cache_misses, "Grammars compiled (not in the cache).")):
            c = CounterMetricFamily(f"pdserve:{name}", doc, labels=["model_name"])
            c.add_metric(m, float(value))
            yield c
        c = CounterMetricFamily("pdserve:structured_output_requests", "Requests with a structured-output constraint.",
                                labels=["model_name", "kind"])
        for kind in KINDS:
            c.add_metric([self.model_name, kind], float(s.requests_by_kind.get(kind, 0)))
        yield c
