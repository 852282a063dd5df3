"""Names, labels and ports shared by the CRD, the builders and the operator (one place, so they cannot drift)."""

from __future__ import annotations

GROUP = "pdserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["pdis"]  # not "isvc": KServe's InferenceService owns that short name
CATEGORIES = ["pdserve"]

FIELD_MANAGER = "pdserve-operator"
DEFAULT_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"

# Labels every owned object carries; the router discovers runtime pods by NAME/INSTANCE and ROLE.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ROLE_LABEL = "pdserve.dev/role"
APP = "pdserve"
MANAGED_BY = "pdserve-operator"
CONFIG_HASH_ANNOTATION = "pdserve.dev/config-hash"

# Container ports (fixed inside the pod; users choose the router Service port).
RUNTIME_PORT = 8000
ROUTER_PORT = 8080
NIXL_PORT = 5600
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558

RUNTIME_ROLES = ("prefill", "decode", "both")

# Writable paths of a read-only root filesystem (the image sets the same env; see Dockerfile).
CACHE_MOUNT = "/cache"
KV_MOUNT = "/kv"
MODELS_MOUNT = "/models"


def base_labels(instance: str) -> dict[str, str]:
    return {NAME_LABEL: APP, INSTANCE_LABEL: instance, MANAGED_BY_LABEL: MANAGED_BY}


def pod_labels(instance: str, role: str) -> dict[str, str]:
    """Labels of one pool's pods: the Deployment selector is exactly this set (it never changes after creation)."""
    component = "router" if role == "router" else "runtime"
    return {NAME_LABEL: APP, INSTANCE_LABEL: instance, COMPONENT_LABEL: component, ROLE_LABEL: role}


def runtime_selector(instance: str) -> str:
    """Label selector (string form) of every runtime pod of one InferenceService: what the router discovers."""
    return f"{NAME_LABEL}={APP},{INSTANCE_LABEL}={instance},{ROLE_LABEL} in (both,decode,prefill)"


def pool_name(instance: str, role: str) -> str:
    """Deployment name of one pool: <isvc>-prefill, <isvc>-decode, <isvc>-router; monolithic pods are <isvc>-decode
    too (role `both`), so that the /scale subresource and the decode printer column always mean the same object."""
    return f"{instance}-{'decode' if role == 'both' else role}"


def router_service_name(instance: str) -> str:
    return instance


def headless_service_name(instance: str) -> str:
    return f"{instance}-pods"


def router_account_name(instance: str) -> str:
    return f"{instance}-router"


def config_map_name(instance: str) -> str:
    return f"{instance}-config"


def kv_token_secret_name(instance: str) -> str:
    return f"{instance}-kv-token"
