"""Least-loaded picker: the pod with the smallest load (max of router in-flight and pod waiting+running);
ties go to fewer router in-flight requests, then the first candidate."""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Picker, RequestContext, register


@register("least-loaded")
class LeastLoadedPicker(Picker):
    def pick(self, ctx: RequestContext, pods: list[Endpoint], scores: list[float]) -> Endpoint:
        return min(pods, key=lambda p: (p.load, p.in_flight))
