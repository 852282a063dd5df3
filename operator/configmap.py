"""Shared settings of one InferenceService's pods: the ConfigMap, the KV connector config, the KV-transfer token.

- ConfigMap ``<isvc>-config``: the ``PDSERVE_*`` environment every pod (runtime and router) loads with ``envFrom``, so
  settings that must agree across processes (the block-hash seed) cannot drift. Its hash is a pod-template
  annotation: a change rolls the pods.
- ``--kv-connector-config`` JSON: built here, passed inline in the runtime args. It may reference env vars as
  ``$(VAR)``, which the kubelet expands when it starts the container: NIXL advertises ``$(POD_IP)``; a Redis URL kept in
  a Secret is ``"url": "$(PDSERVE_REDIS_URL)"`` (the pod spec never holds the URL itself).
- Secret ``<isvc>-kv-token``: a random token authenticating KV-transfer side channels (``PDSERVE_KV_TOKEN``,
  runtime/envs.kv_transfer_token), created once and never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from pdserve.operator import names
from pdserve.operator.models import InferenceServiceSpec
from pdserve.operator.pod import object_meta
from pdserve.runtime import envs

REDIS_URL_ENV = "PDSERVE_REDIS_URL"
POD_IP_ENV = "POD_IP"
KV_TOKEN_ENV = "PDSERVE_KV_TOKEN"
KV_TOKEN_KEY = "token"


def kv_connector_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The JSON given to ``--kv-connector-config`` for the chosen connector (``$(VAR)`` expanded by the kubelet)."""
    kv = spec.kv_transfer
    if kv.connector == "nixl":
        # The side channel and UCX listen on the pod IP only (kv_connectors/ucx_bind.py), not on every interface.
        return {"host": f"$({POD_IP_ENV})", "port": names.NIXL_PORT, "advertise_host": f"$({POD_IP_ENV})"}
    if kv.connector == "redis":
        assert kv.redis is not None  # CEL rule on the CRD
        return {"url": kv.redis.url or f"$({REDIS_URL_ENV})"}
    assert kv.disk is not None  # CEL rule on the CRD
    return {"path": f"{names.KV_MOUNT}/{kv.disk.path}".rstrip("/")}


def shared_env() -> dict[str, str]:
    """PDSERVE_* variables every process of one InferenceService must agree on (see runtime/envs.py)."""
    env = {"PDSERVE_HASH_SEED": "pdserve", "PDSERVE_CACHE_DIR": f"{names.CACHE_MOUNT}/pdserve",
           "PDSERVE_LOG_LEVEL": "INFO"}
    # Tracing (pdserve/tracing.py), when the operator was told where the collector is (chart value tracing.*).
    if envs.pod_otlp_traces_endpoint():
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = envs.pod_otlp_traces_endpoint()
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = envs.pod_otlp_traces_protocol() or "http/protobuf"
    return env


def config_hash(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_config_map(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(names.config_map_name(name), namespace, name),
            "data": shared_env()}


def env_from(name: str) -> list[dict[str, Any]]:
    return [{"configMapRef": {"name": names.config_map_name(name)}}]


def build_kv_token_secret(name: str, namespace: str, token: str | None = None) -> dict[str, Any]:
    """Secret ``<isvc>-kv-token``; create-only (applying it again would rotate the token under running pods)."""
    meta = object_meta(names.kv_token_secret_name(name), namespace, name)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "stringData": {KV_TOKEN_KEY: token or secrets.token_urlsafe(32)}}
