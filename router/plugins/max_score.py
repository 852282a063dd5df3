"""Max-score picker: the highest weighted score wins; ties are broken at random so equal pods share the load."""

from __future__ import annotations

import random

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Picker, RequestContext, register


@register("max-score")
class MaxScorePicker(Picker):
    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)

    def pick(self, ctx: RequestContext, pods: list[Endpoint], scores: list[float]) -> Endpoint:
        best = max(scores)
        top = [p for p, s in zip(pods, scores) if s >= best - 1e-9]
        return top[0] if len(top) == 1 else self.rng.choice(top)
