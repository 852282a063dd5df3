"""The operator's own least-privilege RBAC rules: exactly the verbs and resources kube.py and kopf use.

`python -m pdserve.operator.crdgen` writes them into the chart (files/rbac-rules.yaml, rendered by
templates/rbac.yaml); the drift test fails when the chart's copy is stale.
"""

from __future__ import annotations

from pdserve.operator import names
from pdserve.operator.router_objects import ROUTER_RULES

CHILD_VERBS = ["get", "list", "watch", "create", "patch", "delete"]  # server-side apply = create/patch

NAMESPACED_RULES = [
    # kopf watches InferenceServices, keeps handler progress in annotations (patch); status via the subresource.
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "verbs": ["get", "patch"]},
    # owner references with blockOwnerDeletion need update on the owner's finalizers (OwnerReferencesPermissionEnforcement)
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["configmaps", "services", "serviceaccounts"], "verbs": CHILD_VERBS},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": CHILD_VERBS},
    # the autoscaler writes decode replicas through /scale (it lists pods under ROUTER_RULES' pod reads)
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/scale"], "verbs": ["get", "patch"]},
    # create: the per-InferenceService KV-transfer token (created once, never updated); get: the runtime API key
    # (spec.runtime.apiKeySecretRef) the operator presents to the pods' LoRA load/unload API (lora_sync.py)
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": CHILD_VERBS},
    # held only so the operator may grant them to each router's Role (RBAC forbids granting what one lacks)
    *ROUTER_RULES,
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
]

# Cluster-scoped reads kopf needs in every mode: it discovers custom resources and notices CRD changes.
CLUSTER_RULES = [
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
]


def chart_rules() -> dict[str, list[dict]]:
    """The chart's charts/pdserve/files/rbac-rules.yaml (written by crdgen): a ClusterRole gets both lists when the
    operator watches all namespaces; otherwise each watched namespace gets a Role with ``namespaced``."""
    return {"namespaced": NAMESPACED_RULES, "cluster": CLUSTER_RULES}
