"""Scheduling framework (GIE style): Filter -> Scorer -> Picker, each a plugin registered by name.

A ``Profile`` narrows the candidate pods with its filters (in order; a filter that would leave nothing is skipped, so
filters express preferences that never make a routable request unroutable — except the health filter, which is
``strict``), asks each scorer for a score in [0, 1] per pod, sums them with the profile's weights, and lets the picker
choose. Plugins are stateless per request except through ``RequestContext`` (per request) and their own fields (e.g.
round-robin's counter). A new plugin is one module in ``router/plugins/`` plus ``@register("name")``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdserve.router.endpoints import Endpoint


@dataclass
class RequestContext:
    """What plugins may read about one request. Token ids/hashes are filled only when a policy or P/D needs them."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]                     # lower-case names
    request_id: str
    num_prompt_tokens: int = 0                  # exact when tokenized, else estimated (4 chars/token)
    block_hashes: list[bytes] = field(default_factory=list)  # base-model hashes; empty for an adapter: hashes_for
    matched_blocks: dict[str, float] = field(default_factory=dict)  # pod url -> cached leading blocks (prefix scorer)
    lora_name: str | None = None                # the adapter ``model`` names (None: the base model)
    lora_block_hashes: dict[str, list[bytes]] = field(default_factory=dict)  # adapter weight digest -> block hashes

    def hashes_for(self, pod: Endpoint) -> list[bytes]:
        """The prompt's block hashes as ``pod``'s engine keys them: with the digest of the adapter's weights there
        (runtime/block_hash.py), none for a pod without the adapter, so base and adapter blocks never match."""
        if self.lora_name is None:
            return self.block_hashes
        return self.lora_block_hashes.get(pod.lora_digests.get(self.lora_name, ""), [])


class Filter(ABC):
    name: str = ""
    strict = False  # a strict filter may leave no candidates (the request then fails with 503)

    @abstractmethod
    def filter(self, ctx: RequestContext, pods: list[Endpoint]) -> list[Endpoint]:
        """Return the subset of ``pods`` (same objects) this filter accepts."""


class Scorer(ABC):
    name: str = ""

    @abstractmethod
    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        """One score in [0, 1] per pod, aligned with ``pods``; higher is better."""


class Picker(ABC):
    name: str = ""

    @abstractmethod
    def pick(self, ctx: RequestContext, pods: list[Endpoint], scores: list[float]) -> Endpoint:
        """Choose one of ``pods`` (non-empty) given the weighted total ``scores`` aligned with it."""


_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def create(name: str, **kwargs: Any) -> Any:
    import pdserve.router.plugins  # noqa: F401  (registers every plugin)

    try:
        return _REGISTRY[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown router plugin {name!r}; known: {sorted(_REGISTRY)}") from None


@dataclass
class Decision:
    endpoint: Endpoint
    score: float
    scores: dict[str, list[float]]   # per scorer, aligned with ``candidates`` (for metrics and debugging)
    candidates: list[Endpoint]


class Profile:
    def __init__(self, filters: Sequence[Filter], scorers: Sequence[tuple[Scorer, float]], picker: Picker):
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker

    def schedule(self, ctx: RequestContext, pods: Sequence[Endpoint]) -> Decision | None:
        """Pick a pod among ``pods``, or None when no pod is acceptable."""
        cands = list(pods)
        for f in self.filters:
            kept = f.filter(ctx, cands)
            if kept or f.strict:
                cands = kept
        if not cands:
            return None
        total = [0.0] * len(cands)
        per: dict[str, list[float]] = {}
        for scorer, weight in self.scorers:
            s = scorer.score(ctx, cands)
            per[scorer.name] = s
            for i, v in enumerate(s):
                total[i] += weight * v
        ep = self.picker.pick(ctx, cands, total)
        return Decision(ep, total[cands.index(ep)], per, cands)
