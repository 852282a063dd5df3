"""Route-history scorer: the fraction of the prompt's leading blocks that were last routed to the pod.

Complements the precise prefix scorer with stickiness: after a pod evicts a prefix (its KV events say so), the
precise score is 0 everywhere, and without history the next request of that tenant would land wherever load says,
re-warming the prefix on a new pod and evicting another tenant's there. History (from ``PrefixIndex.match_history``)
sends it back to its last pod. Weighted below the precise scorer, which wins whenever it knows better.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register
from pdserve.router.prefix_index import PrefixIndex


@register("route-history")
class RouteHistoryScorer(Scorer):
    def __init__(self, index: PrefixIndex):
        self.index = index

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        n = len(ctx.block_hashes)
        if n == 0:
            return [0.0] * len(pods)
        matched = self.index.match_history(ctx.block_hashes, [p.url for p in pods])
        return [matched[p.url] / n for p in pods]
