"""Queue scorer: fewer waiting requests (``vllm:num_requests_waiting`` scraped from the pod) is better.

score = 1 / (1 + waiting / scale): 1 for an empty queue, 0.5 at ``scale`` waiting requests. A saturating curve rather
than GIE's min-max normalisation, so that one waiting request on a small deployment does not cost a pod the scorer's
whole weight (which would outvote a long cached prefix); the load guard handles real imbalance.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register


def saturating(values: list[float], scale: float) -> list[float]:
    return [1.0 / (1.0 + max(0.0, v) / scale) for v in values]


@register("queue")
class QueueScorer(Scorer):
    def __init__(self, scale: float = 4.0):
        self.scale = scale

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        return saturating([p.waiting for p in pods], self.scale)
