"""Precise prefix scorer: the fraction of the prompt's full blocks that a pod holds as a leading consecutive run.

Block hashes come from ``RequestContext.hashes_for(pod)``: the router tokenized the rendered prompt and hashed it with
``pdserve.runtime.block_hash``, keyed like the pod's engine keys it (for an adapter request: with the digest of the
adapter's weights on that pod, so base-model blocks never count for an adapter, nor the other way round, and a pod
without the adapter scores 0). Holdings come from the ``PrefixIndex`` fed by the pods' KV events plus speculative
entries. Score = matched_blocks / total_blocks in [0, 1] (0 for prompts shorter than one block). The per-pod matched
block counts are left in ``ctx.matched_blocks`` for the P/D decision and metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register
from pdserve.router.prefix_index import PrefixIndex


@register("precise-prefix")
class PrecisePrefixScorer(Scorer):
    def __init__(self, index: PrefixIndex):
        self.index = index

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        groups: dict[int, tuple[list[bytes], list[str]]] = {}  # pods whose engines key the prompt alike, together
        for p in pods:
            hashes = ctx.hashes_for(p)
            if hashes:
                groups.setdefault(id(hashes), (hashes, []))[1].append(p.url)
        scores: dict[str, float] = {}
        for hashes, urls in groups.values():
            scores.update({url: n / len(hashes) for url, n in self.match(ctx, hashes, urls).items()})
        return [scores.get(p.url, 0.0) for p in pods]

    def match(self, ctx: RequestContext, hashes: Sequence[bytes], urls: list[str]) -> dict[str, float]:
        """Leading blocks of ``hashes`` each pod holds (also recorded in ``ctx.matched_blocks``)."""
        matched = self.index.match(hashes, urls)
        ctx.matched_blocks.update(matched)
        return matched
