"""In-flight scorer: fewer requests this router has outstanding on the pod is better (reacts before scrapes do).

score = 1 / (1 + in_flight / scale), like the queue scorer.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register
from pdserve.router.plugins.queue_scorer import saturating


@register("in-flight")
class InFlightScorer(Scorer):
    def __init__(self, scale: float = 4.0):
        self.scale = scale

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        return saturating([float(p.in_flight) for p in pods], self.scale)
