"""Pod-template pieces shared by the runtime and router Deployments: security context, writable volumes, probes,
secret-backed env vars, graceful termination. Pure functions returning Kubernetes dicts."""

from __future__ import annotations

import re
from typing import Any

from pdserve.operator import names
from pdserve.operator.models import Resources, SecretKeyRef

UID = 10001  # the image's numeric non-root user (Dockerfile)
TERMINATION_GRACE_SECONDS = 60
PRESTOP_SLEEP_SECONDS = 10  # let endpoint removal reach the router before SIGTERM

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(?:([eE][0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E))?$")
_SUFFIX = {None: 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


class InvalidSpec(ValueError):
    """A spec the schema accepted but the operator cannot realise; ``reason`` is a CamelCase Event/condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_bytes(value: int | str, field: str) -> int:
    """A Kubernetes quantity (``2Gi``, ``500M``, ``1e9``, ``1073741824``) as a whole number of bytes."""
    if isinstance(value, int):
        return value
    m = _QUANTITY.match(value.strip())
    if not m:
        raise InvalidSpec("InvalidQuantity", f"{field}: {value!r} is not a byte quantity (e.g. 2Gi, 500M, 1073741824)")
    number, exponent, suffix = m.groups()
    scale = 10 ** int(exponent[1:]) if exponent else _SUFFIX[suffix]
    return int(float(number) * scale) if "." in number else int(number) * scale


def security_context() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts: non-root numeric UID, read-only root, no privilege escalation."""
    pod = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
           "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}}
    return pod, container


def writable_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the only writable paths of a read-only root: /cache (HOME, model cache) and /tmp."""
    volumes = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "cache", "mountPath": names.CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    return volumes, mounts


def secret_env(var: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def http_probes(port_name: str, startup_seconds: int) -> dict[str, Any]:
    """startup (model load/download), readiness (gates traffic) and liveness (restarts a wedged server) on /health."""
    def get() -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": port_name}, "timeoutSeconds": 5}

    return {
        "startupProbe": {**get(), "periodSeconds": 5, "failureThreshold": max(1, startup_seconds // 5)},
        "readinessProbe": {**get(), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**get(), "periodSeconds": 10, "failureThreshold": 6},
    }


def graceful_termination() -> dict[str, Any]:
    """Container lifecycle: sleep before SIGTERM so in-flight requests drain (no shell needed in the image)."""
    return {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}}


def resources(res: Resources | None) -> dict[str, Any]:
    if res is None:
        return {}
    return {k: {q: str(v) for q, v in val.items()} for k, val in (("requests", res.requests), ("limits", res.limits))
            if val}


def owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """Controller owner reference to the InferenceService: children are garbage-collected with it."""
    meta = body["metadata"]
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def object_meta(name: str, namespace: str, instance: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {**names.base_labels(instance), **(labels or {})}}


def deployment(meta: dict[str, Any], replicas: int, pod_labels: dict[str, str], pod_spec: dict[str, Any],
               annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": dict(pod_labels)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": dict(pod_labels), "annotations": dict(annotations)}, "spec": pod_spec},
        },
    }


def runtime_url(pod: dict[str, Any], path: str) -> str | None:
    """http://<podIP>:<the container's `http` port><path> of a live pod (None: no IP yet, or terminating). The address
    is the Pod object's status.podIP as the API server reports it, never anything a pod or client claims."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or pod["metadata"].get("deletionTimestamp"):
        return None
    port = next((p["containerPort"] for c in pod["spec"].get("containers", []) for p in c.get("ports", [])
                 if p.get("name") == "http"), names.RUNTIME_PORT)
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{path}"


def is_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])
