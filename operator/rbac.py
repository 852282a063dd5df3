"""The operator's own least-privilege RBAC rules: exactly the verbs and resources kube.py and kopf use.

The chart renders these rules (charts/pdserve/templates/rbac.yaml); tests/operator checks the two stay equal.
"""

from __future__ import annotations

from pdserve.operator import names
from pdserve.operator.router_objects import ROUTER_RULES

CHILD_VERBS = ["get", "list", "watch", "create", "patch", "delete"]  # server-side apply = create/patch

OPERATOR_RULES = [
    # kopf watches InferenceServices, keeps handler progress in annotations (patch); status via the subresource.
    {"apiGroups": [names.GROUP], "resources": [names.PLURAL], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/status"], "verbs": ["get", "patch"]},
    # owner references with blockOwnerDeletion need update on the owner's finalizers (OwnerReferencesPermissionEnforcement)
    {"apiGroups": [names.GROUP], "resources": [f"{names.PLURAL}/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["configmaps", "services", "serviceaccounts"], "verbs": CHILD_VERBS},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": CHILD_VERBS},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": CHILD_VERBS},
    # held only so the operator may grant them to each router's Role (RBAC forbids granting what one lacks)
    *ROUTER_RULES,
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # kopf discovers custom resources and notices CRD changes
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "list", "watch"]},
]
