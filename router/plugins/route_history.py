"""Route-history scorer: the fraction of the prompt's leading blocks that were last routed to the pod.

Complements the precise prefix scorer with stickiness: after a pod evicts a prefix (its KV events say so), the
precise score is 0 everywhere, and without history the next request of that tenant would land wherever load says,
re-warming the prefix on a new pod and evicting another tenant's there. History (from ``PrefixIndex.match_history``)
sends it back to its last pod. Weighted below the precise scorer, which wins whenever it knows better.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.framework import RequestContext, register
from pdserve.router.plugins.precise_prefix import PrecisePrefixScorer


@register("route-history")
class RouteHistoryScorer(PrecisePrefixScorer):
    """Scores like the precise prefix scorer, from where prefixes were last routed instead of what pods hold."""

    def match(self, ctx: RequestContext, hashes: Sequence[bytes], urls: list[str]) -> dict[str, int]:
        return self.index.match_history(hashes, urls)
