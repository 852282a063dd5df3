"""The autoscaler loop of one InferenceService: scrape its runtime pods, decide (autoscale_policy.decide), write.

Called from a kopf timer on every InferenceService (handlers.py); it acts only when ``spec.autoscaling`` lists a
pool and ``intervalSeconds`` have passed since its last round for that object. Level-based: each round reads the
spec, the pods and their metrics as they are now; the only memory kept between rounds is the metric samples and
recommendation history (lost on an operator restart, which only delays scale-down by one window).

Replicas are written where an external autoscaler would write them: decode through the /scale subresource, prefill
through spec.prefill.replicas (one /scale per CRD version); the spec change then rolls into the Deployments through
the usual reconcile. Every change posts a ``ScaledUp``/``ScaledDown`` Event with the reason, and the inputs and
decisions are exported as ``pdserve_operator_autoscale_*`` metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.operator import names
from pdserve.operator import pod as pod_helpers
from pdserve.operator.autoscale_metrics import Windows, scrape
from pdserve.operator.autoscale_policy import Decision, PoolWindow, State, decide
from pdserve.operator.kube import Kube
from pdserve.operator.pod import InvalidSpec
from pdserve.operator.reconcile import parse_spec

log = logging.getLogger(__name__)


class AutoscalerMetrics:
    """The operator's autoscaling metrics (names agreed with the dashboards)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["namespace", "isvc", "role"]
        self.decisions = Counter("pdserve_operator_autoscale_decisions", "Autoscaler replica changes written.",
                                 [*labels, "direction"], registry=registry)
        self.desired = Gauge("pdserve_operator_autoscale_desired_replicas", "Replicas the autoscaler wants.",
                             labels, registry=registry)
        self.ttft_p90 = Gauge("pdserve_operator_autoscale_ttft_p90_seconds", "Pool TTFT p90 over the window.",
                              labels, registry=registry)
        self.itl_p90 = Gauge("pdserve_operator_autoscale_itl_p90_seconds", "Pool ITL p90 over the window.",
                             labels, registry=registry)
        self.prompt_tps = Gauge("pdserve_operator_autoscale_prompt_tokens_per_second",
                                "Pool uncached prompt tokens per second over the window.", labels, registry=registry)
        self.waiting = Gauge("pdserve_operator_autoscale_queue_depth", "Mean waiting requests per pod.", labels,
                             registry=registry)
        self.kv_usage = Gauge("pdserve_operator_autoscale_kv_cache_usage", "Mean KV-cache usage per pod.", labels,
                              registry=registry)
        self.pods_scraped = Gauge("pdserve_operator_autoscale_pods_scraped", "Pods whose metrics were used.", labels,
                                  registry=registry)

    def observe(self, ns: str, name: str, role: str, w: PoolWindow, d: Decision) -> None:
        lv = (ns, name, role)
        self.desired.labels(*lv).set(d.desired)
        self.pods_scraped.labels(*lv).set(w.pods_scraped)
        self.prompt_tps.labels(*lv).set(w.prompt_tokens_per_s)
        self.waiting.labels(*lv).set(w.waiting)
        self.kv_usage.labels(*lv).set(w.kv_cache_usage)
        for gauge, hist in ((self.ttft_p90, w.ttft), (self.itl_p90, w.itl)):
            p90 = hist.quantile(0.9)
            if p90 is not None:
                gauge.labels(*lv).set(p90)
        if d.direction != "none":
            self.decisions.labels(*lv, d.direction).inc()


@dataclass
class _Instance:
    uid: str
    windows: Windows = field(default_factory=Windows)
    state: State = field(default_factory=State)
    last_round: float = float("-inf")


def pool_role(role: str, disaggregated: bool) -> str:
    """The pod role label of an autoscaled pool: the decode pool is role `both` when monolithic."""
    return role if role == "prefill" or disaggregated else "both"


class Autoscaler:
    """Per-operator autoscaler state: one ``_Instance`` per autoscaled InferenceService."""

    def __init__(self, kube: Kube, registry: CollectorRegistry, clock=time.monotonic) -> None:
        self.kube, self.metrics, self.clock = kube, AutoscalerMetrics(registry), clock
        self.instances: dict[tuple[str, str], _Instance] = {}
        self.session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def forget(self, ns: str, name: str) -> None:
        self.instances.pop((ns, name), None)

    async def tick(self, body: dict[str, Any]) -> list[Decision]:
        """One round for ``body`` if it is autoscaled and its interval has passed; the decisions taken (may be [])."""
        meta = body["metadata"]
        ns, name, key = meta["namespace"], meta["name"], (meta["namespace"], meta["name"])
        try:
            spec = parse_spec(body)
        except InvalidSpec:
            return []  # reported by the reconciler
        auto = spec.autoscaling
        if auto is None or meta.get("deletionTimestamp") or not (auto.prefill or auto.decode):
            self.forget(ns, name)
            return []
        inst = self.instances.get(key)
        if inst is None or inst.uid != meta["uid"]:
            inst = self.instances[key] = _Instance(meta["uid"])
        now = self.clock()
        if now - inst.last_round < auto.interval_seconds - 0.05:
            return []
        inst.last_round = now
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        pools, seen = {}, set()
        for role, target, pool in (("prefill", auto.prefill, spec.prefill), ("decode", auto.decode, spec.decode)):
            if target is None or pool is None:
                continue
            pods = await self.kube.list_pods(ns, names.pod_labels(name, pool_role(role, spec.prefill is not None)))
            uids = [p["metadata"]["uid"] for p in pods]
            seen.update(uids)
            urls = {p["metadata"]["uid"]: pod_helpers.runtime_url(p, "/metrics") for p in pods}
            samples = await asyncio.gather(*(scrape(self.session, u, now) for u in urls.values() if u))
            for uid, sample in zip([u for u, url in urls.items() if url], samples):
                if sample is not None:
                    inst.windows.record(uid, sample, auto.window_seconds)
            ready = sum(pod_helpers.is_ready(p) for p in pods if not p["metadata"].get("deletionTimestamp"))
            pools[role] = (target, inst.windows.pool(uids, pool.replicas, ready, now))
        inst.windows.forget_except(seen)
        decisions, inst.state = decide(now, pools, inst.state)
        for d in decisions:
            self.metrics.observe(ns, name, d.role, pools[d.role][1], d)
            if d.direction == "none":
                continue
            try:
                await self.kube.set_replicas(ns, name, d.role, d.desired)
            except ApiException as e:
                if e.status == 404:  # deleted meanwhile
                    self.forget(ns, name)
                    return decisions
                raise
            reason = "ScaledUp" if d.direction == "up" else "ScaledDown"
            message = f"{d.role} {d.current} -> {d.desired}: {d.reason}"
            log.info("%s/%s %s: %s", ns, name, reason, message)
            try:
                await self.kube.post_event(body, "Normal", reason, message)
            except (ApiException, aiohttp.ClientError, asyncio.TimeoutError) as e:  # an Event is best effort
                log.warning("%s/%s: could not post %s Event: %s", ns, name, reason, e)
        return decisions
