"""PodDisruptionBudget of one pool: voluntary disruptions (node drains, evictions) take its pods one at a time.

``maxUnavailable: 1`` rather than a ``minAvailable``: a pool of one replica can still be drained (it goes, is
re-created elsewhere, and the router sends its requests to the other pool or waits for it), while a larger pool never
loses more than one pod at once to an eviction. Rolling updates are bounded by the Deployment's own strategy
(maxUnavailable 0), not by this budget.
"""

from __future__ import annotations

from typing import Any

from pdserve.operator import names, pod


def build_pdb(name: str, namespace: str, role: str) -> dict[str, Any]:
    """PDB ``names.pool_name(name, role)`` selecting exactly that pool's pods (role prefill, decode, both, router)."""
    labels = names.pod_labels(name, role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": pod.object_meta(names.pool_name(name, role), namespace, name, labels),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels},
                     # a pod that is not ready serves nothing: evicting it never costs availability
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}
