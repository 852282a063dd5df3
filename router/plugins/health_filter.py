"""Keep pods that pass active health checks and whose circuit breaker admits a request (strict: may leave none)."""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Filter, RequestContext, register


@register("health")
class HealthFilter(Filter):
    strict = True

    def filter(self, ctx: RequestContext, pods: list[Endpoint]) -> list[Endpoint]:
        return [p for p in pods if p.routable]
