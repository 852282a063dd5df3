"""kopf handlers: thin adapters from events to ``sync`` (fetch observed -> reconcile -> apply -> status).

- create / update (spec) / resume of an InferenceService, and a per-object timer: full sync (apply every child, prune
  what is no longer wanted), so a deleted or edited child comes back within one resync interval.
- events of owned Deployments/Services: a deleted child, or one whose spec changed (its generation moved, e.g. a hand
  edit), triggers a full sync of its owner at once; any other change only refreshes the owner's status (status
  follows the children's readyReplicas). Other kinds (ConfigMap, RBAC, Secret) are repaired by the timer.
- with LoRA on, every sync also brings each ready runtime pod to spec.loras through the pod's load/unload API
  (lora_sync.py): Deployment status changes (a pod turned Ready) and the resync timer keep new pods in step.
- a timer per autoscaled InferenceService (spec.autoscaling) runs the autoscaler (autoscaler.py), which writes
  replicas into the spec; the spec change then reconciles like any other.
- an invalid spec (one the CRD schema let through) sets Ready=False with the reason, posts a Warning Event once per
  generation and raises ``kopf.PermanentError`` from create/update (no retry loop); running children are left alone.

kopf keeps its handler progress in annotations (not in ``status``, which the CRD schema owns), never adds finalizers
(the deletion handler is optional and only forgets in-memory state: children go by owner-reference garbage
collection), and runs standalone (no peering objects).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from prometheus_client import CollectorRegistry

from pdserve.operator import names
from pdserve.operator.autoscaler import Autoscaler
from pdserve.operator.kube import Kube
from pdserve.operator.metrics import OperatorMetrics
from pdserve.operator.lora_sync import AdapterSync
from pdserve.operator.reconcile import parse_spec, reconcile
from pdserve.operator.runtime_deployment import lora_enabled, lora_paths

ISVC = (names.GROUP, names.VERSION, names.PLURAL)


async def sync(memo: Any, body: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter, *,
               repair: bool, raise_invalid: bool = False) -> None:
    """Reconcile one InferenceService; serialised per object so handlers never interleave their applies."""
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    if meta.get("deletionTimestamp") or memo.closing:
        return
    kube: Kube = memo.kube
    key = (ns, name)
    async with (memo.locks.setdefault(key, asyncio.Lock()),
                memo.metrics.reconcile("full" if repair else "status") as m):
        # The body may predate our last status patch (handlers queue on the lock): trust what we last wrote.
        last = memo.statuses.get(key)
        if last is not None and last[0] == uid:
            body = {**body, "status": last[1]}
        observed = await kube.observe(ns, name, uid)
        result = reconcile(body, observed)
        old_status = body.get("status") or {}
        if result.error:
            m["result"] = "invalid"
            old_ready = next((c for c in old_status.get("conditions") or [] if c.get("type") == "Ready"), {})
            first_time = (old_status.get("observedGeneration") != meta.get("generation")
                          or old_ready.get("message") != str(result.error))
            if first_time and await kube.patch_status(ns, name, result.status):
                memo.statuses[key] = (uid, {**old_status, **result.status})
                kopf.warn(body, reason=result.error.reason, message=str(result.error))
                logger.warning("invalid spec: %s (%s)", result.error, result.error.reason)
            if raise_invalid:
                raise kopf.PermanentError(f"{result.error.reason}: {result.error}")
            return
        if repair:
            for obj in result.create_only:
                await kube.create_if_missing(obj)
            for obj in result.objects:
                await kube.apply(obj)
            for kind, child in result.prune:
                logger.info("deleting %s %s/%s: no longer in the spec", kind, ns, child)
                await kube.delete(kind, ns, child)
            observed = await kube.observe(ns, name, uid)
        spec = parse_spec(body)
        if lora_enabled(spec):  # bring every ready runtime pod to spec.loras through its API (lora_sync.py)
            observed.adapters = await memo.adapters.sync(body, spec, lora_paths(spec))
        if repair or observed.adapters is not None:
            result = reconcile(body, observed)
        memo.metrics.pool_status(ns, name, result.status)
        if any(old_status.get(k) != v for k, v in result.status.items()):
            if not await kube.patch_status(ns, name, result.status):
                return  # deleted meanwhile: its children go by garbage collection
            memo.statuses[key] = (uid, {**old_status, **result.status})
            logger.info("status: phase=%s %s", result.status["phase"],
                        " ".join(f"{k}={result.status[k]['ready']}" for k in ("prefill", "decode", "router")
                                 if result.status.get(k)))


def register(registry: kopf.OperatorRegistry, resync_seconds: float, autoscale_tick_seconds: float = 5.0,
             metrics: CollectorRegistry | None = None) -> kopf.OperatorRegistry:
    """Register every handler on ``registry`` (a fresh registry per operator run keeps tests independent);
    ``metrics`` receives the operator's own metrics (the CLI serves it when asked to)."""
    metrics = metrics if metrics is not None else CollectorRegistry()
    operator_metrics = OperatorMetrics(metrics)   # reconciles; the autoscaler registers its own in the same registry

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration")
        settings.posting.level = logging.WARNING  # Events only for problems, not for every handler success
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        memo.kube = await Kube.connect()
        memo.metrics = operator_metrics
        memo.closing = False
        memo.locks = {}
        memo.statuses = {}  # (namespace, name) -> (uid, status last written), see sync()
        memo.generations = {}  # (kind, namespace, name) -> last seen metadata.generation of owned children
        memo.autoscaler = Autoscaler(memo.kube, metrics if metrics is not None else CollectorRegistry())
        memo.adapters = AdapterSync(memo.kube)

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf only auto-detects the sync `kubernetes`/`pykube` clients; we use its own in-cluster/kubeconfig readers.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        memo.closing = True  # timers may still fire while kopf stops: let running syncs finish, start no new ones
        for _ in range(100):
            if not any(lock.locked() for lock in memo.locks.values()):
                break
            await asyncio.sleep(0.1)
        await memo.autoscaler.close()
        await memo.adapters.close()
        await memo.kube.close()

    @kopf.on.resume(*ISVC, id="reconcile", registry=registry)
    @kopf.on.create(*ISVC, id="reconcile", registry=registry)
    @kopf.on.update(*ISVC, id="reconcile", field="spec", registry=registry)
    async def changed(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        await sync(memo, dict(body), logger, repair=True, raise_invalid=True)

    @kopf.on.delete(*ISVC, id="forget", optional=True, registry=registry)  # optional: no finalizer; children go by GC
    async def deleted(body: kopf.Body, memo: Any, **_: Any) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        memo.statuses.pop(key, None)
        memo.locks.pop(key, None)
        memo.metrics.forget(*key)
        memo.autoscaler.forget(*key)
        memo.adapters.forget(*key)

    @kopf.timer(*ISVC, id="resync", interval=resync_seconds, initial_delay=resync_seconds, registry=registry)
    async def resync(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        await sync(memo, dict(body), logger, repair=True)

    @kopf.timer(*ISVC, id="autoscale", interval=autoscale_tick_seconds, registry=registry,
                when=lambda spec, **_: bool(spec.get("autoscaling")))
    async def autoscale(body: kopf.Body, memo: Any, **_: Any) -> None:
        # the timer ticks often; Autoscaler.tick acts once per spec.autoscaling.intervalSeconds per object
        if not memo.closing:
            await memo.autoscaler.tick(dict(body))

    owned = {names.MANAGED_BY_LABEL: names.MANAGED_BY}

    @kopf.on.event("apps", "v1", "deployments", id="child", labels=owned, registry=registry)
    @kopf.on.event("v1", "services", id="child", labels=owned, registry=registry)
    async def child_changed(event: kopf.RawEvent, body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        owner = next((r for r in body.get("metadata", {}).get("ownerReferences", [])
                      if r.get("controller") and r.get("kind") == names.KIND), None)
        if owner is None:
            return
        meta = body["metadata"]
        key = (body.get("kind"), meta["namespace"], meta["name"])
        # Repair when the child is gone or its spec changed (generation moved); status-only changes just refresh.
        if event["type"] == "DELETED":
            memo.generations.pop(key, None)
            repair = True
        else:
            previous = memo.generations.get(key)
            memo.generations[key] = meta.get("generation")
            repair = previous is not None and previous != meta.get("generation")
        parent = await memo.kube.get(names.KIND, meta["namespace"], owner["name"])
        if parent is None or parent["metadata"]["uid"] != owner["uid"]:
            return
        await sync(memo, parent, logger, repair=repair)

    return registry
