"""The ConfigMap of one InferenceService: the KV connector settings every runtime pod reads.

Runtime pods get ``PDSERVE_KV_CONNECTOR_CONFIG`` from this ConfigMap and pass it as
``--kv-connector-config $(PDSERVE_KV_CONNECTOR_CONFIG)`` (the kubelet expands ``$(VAR)`` in args). Its hash is a pod
template annotation, so a change rolls the pods. The KV-transfer token lives in a Secret the operator creates once per InferenceService (random,
never overwritten) and exports as ``PDSERVE_KV_TOKEN``. Secrets never enter the ConfigMap: a Redis URL from a Secret is
exported as ``PDSERVE_REDIS_URL`` and the connector config names it with ``"url_env"``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from pdserve.operator import names
from pdserve.operator.models import InferenceServiceSpec
from pdserve.operator.pod import object_meta

CONFIG_KEY = "kv-connector-config"
CONNECTOR_KEY = "kv-connector"
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
KV_TOKEN_ENV = "PDSERVE_KV_TOKEN"  # runtime/envs.kv_transfer_token(): authenticates KV-transfer side channels
KV_TOKEN_KEY = "token"


def kv_connector_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The JSON given to ``--kv-connector-config`` for the chosen connector."""
    kv = spec.kv_transfer
    if kv.connector == "nixl":
        return {"host": "0.0.0.0", "port": names.NIXL_PORT}
    if kv.connector == "redis":
        assert kv.redis is not None  # CEL rule on the CRD
        return {"url": kv.redis.url} if kv.redis.url else {"url_env": REDIS_URL_ENV}
    assert kv.disk is not None  # CEL rule on the CRD
    return {"path": f"{names.KV_MOUNT}/{kv.disk.path}".rstrip("/")}


def config_hash(data: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def build_config_map(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    data = {CONNECTOR_KEY: spec.kv_transfer.connector,
            CONFIG_KEY: json.dumps(kv_connector_config(spec), sort_keys=True, separators=(",", ":")),
            "runtime-selector": names.runtime_selector(name)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(names.config_map_name(name), namespace, name),
            "data": data}


def build_kv_token_secret(name: str, namespace: str, token: str | None = None) -> dict[str, Any]:
    """Secret ``<isvc>-kv-token``; create-only (applying it again would rotate the token under running pods)."""
    meta = object_meta(names.kv_token_secret_name(name), namespace, name)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "stringData": {KV_TOKEN_KEY: token or secrets.token_urlsafe(32)}}
