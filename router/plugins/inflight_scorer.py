"""In-flight scorer: fewer requests this router has outstanding on the pod is better (reacts before scrapes do).

Min-max normalised like the queue scorer: score = 1 - (n - min) / (max - min); all equal -> 1.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register
from pdserve.router.plugins.queue_scorer import min_max_inverse


@register("in-flight")
class InFlightScorer(Scorer):
    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        return min_max_inverse([float(p.in_flight) for p in pods])
