"""Queue scorer: fewer waiting requests (``vllm:num_requests_waiting`` scraped from the pod) is better.

Min-max normalised over the candidates like GIE's: score = 1 - (w - min) / (max - min); all equal -> 1.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register


def min_max_inverse(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [1.0] * len(values)
    return [1.0 - (v - lo) / (hi - lo) for v in values]


@register("queue")
class QueueScorer(Scorer):
    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        return min_max_inverse([p.waiting for p in pods])
