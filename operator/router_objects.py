"""The router of one InferenceService: its Deployment and the ServiceAccount/Role/RoleBinding that let it watch the
runtime pods (and nothing else) in its namespace."""

from __future__ import annotations

from typing import Any

from pdserve.operator import names, pod
from pdserve.operator.configmap import KV_TOKEN_ENV, KV_TOKEN_KEY, env_from
from pdserve.operator.models import InferenceServiceSpec

API_KEY_ENV = "PDSERVE_API_KEY"  # runtime/envs.api_key()
UPSTREAM_API_KEY_ENV = "PDSERVE_UPSTREAM_API_KEY"  # router/cli.py: the key the runtime pods require
# Before it listens, the router resolves the default model's tokenizer in a subprocess that imports torch and converts the
# GGUF once per pod: minutes on a small or busy node (on a shared 2-core node 120 s was a crash loop of startup kills).
STARTUP_SECONDS = 600

# Exactly what endpoint discovery reads; the operator must hold these itself to grant them (RBAC escalation check).
ROUTER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
]


def router_args(name: str, namespace: str, spec: InferenceServiceSpec) -> list[str]:
    r = spec.router
    args = ["router", "--host", "0.0.0.0", "--port", str(names.ROUTER_PORT), "--discover", names.runtime_selector(name),
            "--namespace", namespace, "--role-label", names.ROLE_LABEL, "--policy", r.policy,
            "--pd-threshold", str(r.pd_threshold), "--block-size", str(spec.runtime.block_size),
            "--kv-events-port", str(names.KV_EVENTS_PORT), "--kv-events-replay-port", str(names.KV_EVENTS_REPLAY_PORT)]
    if r.api_key_secret_ref:
        args += ["--api-key", f"$({API_KEY_ENV})"]
    return args


def build_router_deployment(name: str, namespace: str, spec: InferenceServiceSpec, config_hash: str) -> dict[str, Any]:
    r = spec.router
    volumes, mounts = pod.writable_volumes()
    pod_sc, container_sc = pod.security_context()
    container = {
        "name": "router", "image": r.image or spec.runtime.image, "args": router_args(name, namespace, spec),
        "envFrom": env_from(name), "ports": [{"name": "http", "containerPort": names.ROUTER_PORT}],
        "volumeMounts": mounts,
        "resources": pod.resources(r.resources), "securityContext": container_sc,
        "lifecycle": pod.graceful_termination(), **pod.http_probes("http", STARTUP_SECONDS),
    }
    # The KV secret signs the router's handoff requests to prefill pods (kv_connectors/kv_auth.py).
    env = [{"name": KV_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": names.kv_token_secret_name(name), "key": KV_TOKEN_KEY}}}]
    if r.api_key_secret_ref:
        env.append(pod.secret_env(API_KEY_ENV, r.api_key_secret_ref))
    if spec.runtime.api_key_secret_ref:  # the runtime pods require a key: the router presents theirs (same Secret)
        env.append(pod.secret_env(UPSTREAM_API_KEY_ENV, spec.runtime.api_key_secret_ref))
    container["env"] = env
    if spec.runtime.image_pull_policy:
        container["imagePullPolicy"] = spec.runtime.image_pull_policy
    pod_spec = {"serviceAccountName": names.router_account_name(name), "containers": [container], "volumes": volumes,
                "securityContext": pod_sc, "terminationGracePeriodSeconds": pod.TERMINATION_GRACE_SECONDS}
    labels = names.pod_labels(name, "router")
    meta = pod.object_meta(names.pool_name(name, "router"), namespace, name, labels)
    return pod.deployment(meta, r.replicas, labels, pod_spec, {names.CONFIG_HASH_ANNOTATION: config_hash})


def build_router_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding, all named ``<isvc>-router``."""
    account = names.router_account_name(name)
    meta = pod.object_meta(account, namespace, name, {names.COMPONENT_LABEL: "router"})
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": ROUTER_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]
