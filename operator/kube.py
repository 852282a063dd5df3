"""The operator's Kubernetes API calls: server-side apply, delete, list owned children, read/patch InferenceServices.

Every call retries transient failures (409 conflicts, 429, 5xx, connection errors) with exponential backoff and a
per-request timeout; anything else raises ``ApiException`` for kopf to retry the handler later. Only the kinds in
``KIND_PATHS`` are touched, matching the operator's RBAC (charts/pdserve/templates/rbac.yaml, rbac.OPERATOR_RULES).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from pdserve.operator import names
from pdserve.operator.reconcile import Observed

log = logging.getLogger(__name__)

KIND_PATHS = {  # kind -> (API prefix, plural); all namespaced
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Secret": ("/api/v1", "secrets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Pod": ("/api/v1", "pods"),  # read only: the autoscaler scrapes runtime pods
    "Event": ("/api/v1", "events"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    names.KIND: (f"/apis/{names.API_VERSION}", names.PLURAL),
}
RETRY_STATUS = frozenset({409, 429, 500, 502, 503, 504})
ATTEMPTS = 5
REQUEST_TIMEOUT = 30


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = KIND_PATHS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "")


class Kube:
    """Thin async wrapper over one ``kubernetes_asyncio`` ApiClient (in-cluster config, else KUBECONFIG)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    @classmethod
    async def connect(cls) -> Kube:
        try:
            config.load_incluster_config()
            cfg = client.Configuration.get_default_copy()
        except config.ConfigException:
            cfg = client.Configuration()
            # read KUBECONFIG now (kubernetes_asyncio's default is fixed at import time)
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
        return cls(client.ApiClient(configuration=cfg))

    async def close(self) -> None:
        await self.api.close()

    async def request(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                      content_type: str = "application/json", retry: frozenset[int] = RETRY_STATUS) -> Any:
        for attempt in range(ATTEMPTS):
            try:
                return await self.api.call_api(
                    path, method, query_params=query or [], body=body, auth_settings=["BearerToken"],
                    header_params={"Content-Type": content_type, "Accept": "application/json"},
                    response_types_map={200: "object", 201: "object", 202: "object"},
                    _return_http_data_only=True, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as e:
                if e.status not in retry or attempt == ATTEMPTS - 1:
                    raise
                why = f"HTTP {e.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if attempt == ATTEMPTS - 1:
                    raise
                why = type(e).__name__
            delay = 0.2 * 2**attempt
            log.warning("retrying %s %s after %s (attempt %d, in %.1fs)", method, path, why, attempt + 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager (force: the operator owns these fields). A Deployment
        whose immutable selector changed (monolithic <-> disaggregated) is deleted and re-created."""
        meta = obj["metadata"]
        path = object_path(obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", names.FIELD_MANAGER), ("force", "true")]
        try:
            return await self.request("PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml")
        except ApiException as e:
            if e.status != 422 or "immutable" not in str(e.body):
                raise
            log.info("re-creating %s %s/%s: an immutable field changed", obj["kind"], meta["namespace"], meta["name"])
            await self.delete(obj["kind"], meta["namespace"], meta["name"])
            return await self.request("PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml")

    async def create_if_missing(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        try:
            await self.request("POST", object_path(obj["kind"], meta["namespace"]), body=obj,
                               query=[("fieldManager", names.FIELD_MANAGER)], retry=RETRY_STATUS - {409})
        except ApiException as e:
            if e.status != 409:  # 409 AlreadyExists: keep it as it is
                raise

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self.request("DELETE", object_path(kind, namespace, name),
                               body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", object_path(kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def observe(self, namespace: str, instance: str, owner_uid: str) -> Observed:
        """Deployments, Services and PodDisruptionBudgets controlled by the InferenceService with ``owner_uid``."""
        selector = f"{names.INSTANCE_LABEL}={instance},{names.MANAGED_BY_LABEL}={names.MANAGED_BY}"
        found = []
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            items = (await self.request("GET", object_path(kind, namespace), query=[("labelSelector", selector)]))
            found.append({o["metadata"]["name"]: o for o in items.get("items", [])
                          if any(r.get("controller") and r.get("uid") == owner_uid
                                 for r in o["metadata"].get("ownerReferences", []))})
        return Observed(deployments=found[0], services=found[1], pdbs=found[2])

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        return (await self.request("GET", object_path("Pod", namespace), query=[("labelSelector", selector)])
                ).get("items", [])

    async def set_replicas(self, namespace: str, name: str, role: str, replicas: int) -> None:
        """Decode (or the monolithic pool) through the /scale subresource, prefill through spec.prefill.replicas
        (a CRD version has a single /scale subresource)."""
        path = object_path(names.KIND, namespace, name)
        if role == "prefill":
            body = {"spec": {"prefill": {"replicas": replicas}}}
        else:
            path, body = path + "/scale", {"spec": {"replicas": replicas}}
        await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def post_event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the InferenceService (kopf's poster drops Normal events below its posting level)."""
        meta = body["metadata"]
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta["uid"]},
                 "type": type_, "reason": reason, "message": message[:1024], "firstTimestamp": now,
                 "lastTimestamp": now, "count": 1, "source": {"component": names.FIELD_MANAGER},
                 "reportingComponent": names.FIELD_MANAGER}
        await self.request("POST", object_path("Event", meta["namespace"]), body=event)

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        """Merge-patch the status subresource; False when the InferenceService is gone (deleted meanwhile)."""
        path = object_path(names.KIND, namespace, name) + "/status"
        try:
            await self.request("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True
