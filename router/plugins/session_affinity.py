"""Session affinity scorer: requests carrying the same session header go to the same pod.

Rendezvous (highest-random-weight) hashing of (session, pod url): the top pod scores 1, the rest 0, so when a pod
leaves only its own sessions move. Requests without the header score 0 everywhere (other scorers decide).
"""

from __future__ import annotations

import hashlib

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register


def _weight(session: str, url: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{url}".encode(), digest_size=8).digest()


@register("session-affinity")
class SessionAffinityScorer(Scorer):
    def __init__(self, header: str = "x-session-id"):
        self.header = header.lower()

    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        session = ctx.headers.get(self.header)
        if not session:
            return [0.0] * len(pods)
        weights = [_weight(session, p.url) for p in pods]
        best = max(weights)
        return [1.0 if w == best else 0.0 for w in weights]
