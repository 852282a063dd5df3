"""Services of one InferenceService: the router's (the user-facing endpoint) and a headless one over the runtime
pods (stable DNS per pod for discovery and debugging; no load balancing)."""

from __future__ import annotations

from typing import Any

from pdserve.operator import names, pod
from pdserve.operator.models import InferenceServiceSpec


def endpoint_url(name: str, namespace: str, spec: InferenceServiceSpec) -> str:
    """In-cluster URL of the OpenAI API (``/v1/...`` below it)."""
    port = spec.router.port
    return f"http://{names.router_service_name(name)}.{namespace}.svc" + ("" if port == 80 else f":{port}")


def build_router_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    meta = pod.object_meta(names.router_service_name(name), namespace, name, {names.COMPONENT_LABEL: "router"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": spec.router.service_type, "selector": names.pod_labels(name, "router"),
                     "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}]}}


def build_headless_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    labels = names.pod_labels(name, "runtime")
    selector = {k: v for k, v in labels.items() if k != names.ROLE_LABEL}  # every runtime role
    ports = [{"name": "http", "port": names.RUNTIME_PORT, "targetPort": "http", "protocol": "TCP"},
             {"name": "kv-events", "port": names.KV_EVENTS_PORT, "targetPort": "kv-events", "protocol": "TCP"},
             {"name": "kv-replay", "port": names.KV_EVENTS_REPLAY_PORT, "targetPort": "kv-replay", "protocol": "TCP"}]
    if spec.kv_transfer.connector == "nixl" and spec.prefill is not None:
        ports.append({"name": "nixl", "port": names.NIXL_PORT, "targetPort": "nixl", "protocol": "TCP"})
    meta = pod.object_meta(names.headless_service_name(name), namespace, name, {names.COMPONENT_LABEL: "runtime"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"clusterIP": "None", "selector": selector, "ports": ports}}
