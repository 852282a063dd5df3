"""Precise prefix scorer: the fraction of the prompt's full blocks that a pod holds as a leading consecutive run.

Block hashes come from ``RequestContext.block_hashes`` (the router tokenized the rendered prompt and hashed it with
``pdserve.runtime.block_hash``); holdings come from the ``PrefixIndex`` fed by the pods' KV events plus speculative
entries. Score = matched_blocks / total_blocks in [0, 1] (0 for prompts shorter than one block). The per-pod matched
block counts are left in ``ctx.matched_blocks`` for the P/D decision and metrics.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register
from pdserve.router.prefix_index import PrefixIndex


@register("precise-prefix")
class PrecisePrefixScorer(Scorer):
    def __init__(self, index: PrefixIndex):
        self.index = index

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        n = len(ctx.block_hashes)
        if n == 0:
            return [0.0] * len(pods)
        matched = self.match(ctx, [p.url for p in pods])
        return [matched[p.url] / n for p in pods]

    def match(self, ctx: RequestContext, urls: list[str]) -> dict[str, int]:
        """Leading blocks of the prompt each pod holds (also recorded in ``ctx.matched_blocks``)."""
        matched = self.index.match(ctx.block_hashes, urls)
        ctx.matched_blocks.update(matched)
        return matched
