"""Load guard: cache affinity must never pile work onto one pod.

SGLang's imbalance rule applied per pod: a pod is dropped when its load exceeds the least-loaded candidate's by more
than ``abs_threshold`` *and* by more than ``rel_threshold`` times (load = max(router in-flight, pod waiting+running)).
Scorers then only choose among pods that are not far behind the least loaded one.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Filter, RequestContext, register


@register("load-guard")
class LoadGuardFilter(Filter):
    def __init__(self, abs_threshold: float = 16.0, rel_threshold: float = 1.5):
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def filter(self, ctx: RequestContext, pods: list[Endpoint]) -> list[Endpoint]:
        if len(pods) < 2:
            return pods
        loads = [p.load for p in pods]
        low = min(loads)
        return [p for p, l in zip(pods, loads)
                if not (l - low > self.abs_threshold and l > self.rel_threshold * low)]
