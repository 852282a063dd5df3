"""Endpoint sources: static URLs, or Kubernetes pods found by label selector and watched.

Kubernetes: ``PodWatcher`` lists the pods matching the selector, then watches from the list's resourceVersion with
a server-side timeout; on any error (including 410 Gone) it re-lists after a short backoff. After every change it
hands the full set of *ready* pods to ``EndpointPool.update``. A pod becomes an endpoint when it has an IP, is not
terminating, and its Ready condition is True; its role comes from ``role_label`` (prefill|decode|both, default both);
its port is the container port named ``http`` or the configured ``pod_port``. ``pod_to_spec`` is pure, and the watch
loop takes any ``PodSource`` (the real one wraps kubernetes_asyncio; tests may feed a scripted stream).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Protocol

from pdserve.router.config import KVEventSource, RouterConfig
from pdserve.router.endpoints import EndpointPool, EndpointSpec

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


def kv_source_for(cfg: RouterConfig, url: str, host: str) -> KVEventSource | None:
    if url in cfg.kv_event_sources:
        return cfg.kv_event_sources[url]
    if cfg.kv_events_port:
        replay = f"tcp://{host}:{cfg.kv_events_replay_port}" if cfg.kv_events_replay_port else None
        return KVEventSource(f"tcp://{host}:{cfg.kv_events_port}", replay)
    return None


def static_specs(cfg: RouterConfig) -> list[EndpointSpec]:
    from urllib.parse import urlsplit

    out = []
    for urls, role in ((cfg.workers, "both"), (cfg.prefill, "prefill"), (cfg.decode, "decode")):
        for url in urls:
            url = url.rstrip("/")
            out.append(EndpointSpec(url, role, kv_source_for(cfg, url, urlsplit(url).hostname or "127.0.0.1")))
    return out


def pod_to_spec(pod: dict[str, Any], cfg: RouterConfig) -> EndpointSpec | None:
    """The endpoint for a pod (a Kubernetes Pod as a JSON dict), or None if it must not receive traffic."""
    meta, status, spec = pod.get("metadata") or {}, pod.get("status") or {}, pod.get("spec") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp"):
        return None
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
        return None
    role = (meta.get("labels") or {}).get(cfg.role_label, "both")
    if role not in ROLES:
        log.warning("pod %s has unknown role %r; ignored", meta.get("name"), role)
        return None
    port = cfg.pod_port
    for c in spec.get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                port = p.get("containerPort", port)
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{port}"
    return EndpointSpec(url, role, kv_source_for(cfg, url, host))


class PodSource(Protocol):
    async def list(self) -> tuple[list[dict[str, Any]], str]:
        """All matching pods and the list's resourceVersion."""

    def watch(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, pod dict) from ``resource_version`` on; ends on the
        server-side timeout."""


class PodWatcher:
    def __init__(self, cfg: RouterConfig, pool: EndpointPool, source: PodSource, backoff: float = 1.0):
        self.cfg, self.pool, self.source, self.backoff = cfg, pool, source, backoff
        self.pods: dict[str, dict[str, Any]] = {}  # uid or namespace/name -> pod
        self.synced = asyncio.Event()

    @staticmethod
    def _key(pod: dict[str, Any]) -> str:
        m = pod.get("metadata") or {}
        return f"{m.get('namespace')}/{m.get('name')}"

    def _publish(self) -> None:
        specs = [s for s in (pod_to_spec(p, self.cfg) for p in self.pods.values()) if s is not None]
        self.pool.update(specs)

    def apply(self, kind: str, pod: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self.pods[self._key(pod)] = pod
        elif kind == "DELETED":
            self.pods.pop(self._key(pod), None)
        else:
            return
        self._publish()

    async def run(self) -> None:
        while True:
            try:
                items, rv = await self.source.list()
                self.pods = {self._key(p): p for p in items}
                self._publish()
                self.synced.set()
                while True:
                    async for kind, obj in self.source.watch(rv):
                        if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                        rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                        self.apply(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 (any API failure: re-list after a pause, keep the last pod set)
                log.warning("pod discovery: %s; re-listing in %.1fs", e, self.backoff)
                await asyncio.sleep(self.backoff)


class KubePodSource:
    """``PodSource`` over the Kubernetes API (in-cluster config, else ~/.kube/config or KUBECONFIG)."""

    def __init__(self, selector: str, namespace: str | None, watch_timeout: int = 30, request_timeout: float = 10.0,
                 kubeconfig: str | None = None):
        self.selector, self.namespace, self.kubeconfig = selector, namespace, kubeconfig
        self.watch_timeout, self.request_timeout = watch_timeout, request_timeout
        self.api = None

    async def _core(self):
        if self.api is None:
            from kubernetes_asyncio import client, config

            try:
                if self.kubeconfig:
                    raise config.ConfigException("explicit kubeconfig")
                config.load_incluster_config()
                if self.namespace is None:
                    with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                        self.namespace = f.read().strip()
            except config.ConfigException:
                await config.load_kube_config(config_file=self.kubeconfig)
            self.namespace = self.namespace or "default"
            self.api = client.CoreV1Api(client.ApiClient())
        return self.api

    async def list(self) -> tuple[list[dict[str, Any]], str]:
        import json

        api = await self._core()
        resp = await api.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False,
                                             _request_timeout=self.request_timeout)
        data = json.loads(await resp.read())
        return data.get("items", []), data["metadata"].get("resourceVersion", "")

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        from kubernetes_asyncio import watch

        api = await self._core()
        async with watch.Watch() as w:
            async for ev in w.stream(api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                     resource_version=resource_version, timeout_seconds=self.watch_timeout,
                                     allow_watch_bookmarks=True,
                                     _request_timeout=self.watch_timeout + self.request_timeout):
                yield ev["type"], ev["raw_object"]
