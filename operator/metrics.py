"""The operator's reconcile metrics (``pdserve operator --metrics HOST:PORT``), in the registry of one operator run.

- ``pdserve_operator_reconcile_duration_seconds{kind}`` / ``pdserve_operator_reconciles_total{kind,result}``: one
  observation per ``sync`` (kind ``full``: apply + prune + status; ``status``: status refresh only), result ``ok``,
  ``invalid`` (spec rejected) or ``error`` (an exception; kopf retries).
- ``pdserve_operator_pool_replicas{namespace,isvc,role,state}``: desired and ready replicas per pool, from the status
  the operator last computed (what the "pods not ready" alert compares).

The autoscaler registers its own ``pdserve_operator_autoscale_*`` metrics in the same registry.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
POOLS = ("prefill", "decode", "router")


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.reconcile_seconds = Histogram("pdserve_operator_reconcile_duration_seconds",
                                           "Time of one reconcile (observe, apply, status).", ["kind"],
                                           buckets=RECONCILE_BUCKETS, registry=r)
        self.reconciles = Counter("pdserve_operator_reconciles", "Reconciles by kind and result.",
                                  ["kind", "result"], registry=r)
        self.replicas = Gauge("pdserve_operator_pool_replicas", "Replicas of each pool: desired and ready.",
                              ["namespace", "isvc", "role", "state"], registry=r)
        for kind in ("full", "status"):
            for result in ("ok", "invalid", "error"):
                self.reconciles.labels(kind, result)

    @asynccontextmanager
    async def reconcile(self, kind: str) -> AsyncIterator[dict[str, str]]:
        """``async with``: time one reconcile; the caller may set ``result`` in the yielded dict (default ``ok``,
        ``error`` on an exception)."""
        out = {"result": "ok"}
        start = time.perf_counter()
        try:
            yield out
        except BaseException:
            if out["result"] == "ok":   # an invalid spec raises PermanentError after saying so
                out["result"] = "error"
            raise
        finally:
            self.reconcile_seconds.labels(kind).observe(time.perf_counter() - start)
            self.reconciles.labels(kind, out["result"]).inc()

    def pool_status(self, namespace: str, isvc: str, status: dict[str, Any]) -> None:
        for role in POOLS:
            pool = status.get(role)
            if isinstance(pool, dict):
                self.replicas.labels(namespace, isvc, role, "desired").set(pool.get("desiredReplicas", 0))
                self.replicas.labels(namespace, isvc, role, "ready").set(pool.get("readyReplicas", 0))
            elif role in status:   # pool removed (e.g. switched to monolithic)
                self.forget_pool(namespace, isvc, role)

    def forget_pool(self, namespace: str, isvc: str, role: str) -> None:
        for state in ("desired", "ready"):
            try:
                self.replicas.remove(namespace, isvc, role, state)
            except KeyError:
                pass

    def forget(self, namespace: str, isvc: str) -> None:
        for role in POOLS:
            self.forget_pool(namespace, isvc, role)
