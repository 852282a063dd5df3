"""Named routing policies: which filters, weighted scorers and picker make up a scheduling profile.

| policy           | filters                  | scorers (weight)                            | picker       |
|------------------|--------------------------|---------------------------------------------|--------------|
| precise-prefix   | health, lora-registered, | precise-prefix 3, route-history 1, queue 2, | max-score    |
|                  | load-guard               | kv-usage 2, in-flight 1, lora-affinity 2 (0 |              |
|                  |                          | everywhere for base-model requests)         |              |
| round-robin      | health, lora-registered  | -                                           | round-robin  |
| least-loaded     | health, lora-registered  | -                                           | least-loaded |
| session-affinity | health, lora-registered  | session-affinity 10, in-flight 1            | max-score    |

Weights follow GIE/llm-d (prefix 3, queue 2, kv-util 2); ``RouterConfig.weights`` overrides any of them.
"""

from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.framework import Profile, create
from pdserve.router.prefix_index import PrefixIndex

DEFAULT_WEIGHTS = {"precise-prefix": 3.0, "route-history": 1.0, "queue": 2.0, "kv-usage": 2.0, "in-flight": 1.0,
                   "session-affinity": 10.0, "lora-affinity": 2.0}


def needs_tokens(policy: str) -> bool:
    return policy == "precise-prefix"


def build_profile(cfg: RouterConfig, index: PrefixIndex) -> Profile:
    """A fresh profile (own picker state) for ``cfg.policy``; the router builds one for decode and one for prefill."""
    w = {**DEFAULT_WEIGHTS, **cfg.weights}
    health = create("health")
    lora = create("lora-registered")  # adapter requests only to pods that have the adapter (not strict)
    if cfg.policy == "precise-prefix":
        guard = create("load-guard", abs_threshold=cfg.balance_abs_threshold, rel_threshold=cfg.balance_rel_threshold)
        scorers = [(create("precise-prefix", index=index), w["precise-prefix"]),
                   (create("route-history", index=index), w["route-history"]), (create("queue"), w["queue"]),
                   (create("kv-usage"), w["kv-usage"]), (create("in-flight"), w["in-flight"]),
                   (create("lora-affinity"), w["lora-affinity"])]
        return Profile([health, lora, guard], scorers, create("max-score"))
    if cfg.policy == "round-robin":
        return Profile([health, lora], [], create("round-robin"))
    if cfg.policy == "least-loaded":
        return Profile([health, lora], [], create("least-loaded"))
    if cfg.policy == "session-affinity":
        scorers = [(create("session-affinity", header=cfg.session_header), w["session-affinity"]),
                   (create("in-flight"), w["in-flight"])]
        return Profile([health, lora], scorers, create("max-score"))
    raise ValueError(f"unknown policy {cfg.policy!r}")
