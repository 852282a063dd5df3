"""Round-robin picker: cycles through the candidates, ignoring scores."""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Picker, RequestContext, register


@register("round-robin")
class RoundRobinPicker(Picker):
    def __init__(self) -> None:
        self.next = 0

    def pick(self, ctx: RequestContext, pods: list[Endpoint], scores: list[float]) -> Endpoint:
        ep = pods[self.next % len(pods)]
        self.next += 1
        return ep
