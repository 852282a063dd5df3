"""KV-usage scorer: a pod with more free KV cache (1 - ``vllm:kv_cache_usage_perc``) is better."""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register


@register("kv-usage")
class KVUsageScorer(Scorer):
    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - p.kv_usage)) for p in pods]
