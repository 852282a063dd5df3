"""Scale: 50 InferenceServices reconciled to their children and Ready. Records wall time (printed, never asserted:
the machine is shared) and the operator's memory, sampled throughout, whose growth has a generous bound."""

from __future__ import annotations

import time

import psutil
import pytest
import yaml

from pdserve.operator import names

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

COUNT = 50
# Growth of the operator's RSS while it reconciles COUNT InferenceServices (children cached, watches, status patches).
# A few MiB each is already generous; per-object state that leaks (a cache keyed by resourceVersion, a task or informer
# per reconcile) crosses it.
MAX_RSS_GROWTH = 200 * 2**20


def test_fifty_inference_services(cluster, operator, namespace):
    docs = [{"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": f"m{i:02d}"},
             "spec": {"model": {"name": f"model-{i}"}, "runtime": {"kvCacheMemory": "64Mi"}}} for i in range(COUNT)]
    proc = psutil.Process(operator.proc.pid)
    rss_before = peak = proc.memory_info().rss

    def sample() -> None:
        nonlocal peak
        peak = max(peak, proc.memory_info().rss)

    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))

    def count(path: str) -> int:
        sample()
        return len(cluster.get(path.format(ns=namespace) + f"?labelSelector={names.MANAGED_BY_LABEL}="
                               f"{names.MANAGED_BY}")["items"])

    # monolithic: decode + router Deployments, router + headless Services per InferenceService
    cluster.wait_for(lambda: count("/apis/apps/v1/namespaces/{ns}/deployments") == 2 * COUNT
                     and count("/api/v1/namespaces/{ns}/services") == 2 * COUNT
                     and count("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings") == COUNT,
                     300, f"children of {COUNT} InferenceServices", interval=1)
    t_children = time.monotonic() - t0

    def all_ready() -> bool:
        sample()
        items = cluster.get(f"/apis/{names.API_VERSION}/namespaces/{namespace}/{names.PLURAL}")["items"]
        return len(items) == COUNT and all((i.get("status") or {}).get("phase") == "Ready" for i in items)
    cluster.wait_for(all_ready, 600, f"{COUNT} InferenceServices Ready", interval=2)
    t_ready = time.monotonic() - t0
    sample()
    print(f"\n[scale] {COUNT} InferenceServices: children in {t_children:.1f}s, all Ready in {t_ready:.1f}s; "
          f"operator RSS {rss_before / 2**20:.0f} MiB before, peak {peak / 2**20:.0f} MiB "
          f"(+{(peak - rss_before) / 2**20:.0f} MiB)")
    assert operator.proc.poll() is None
    assert peak - rss_before < MAX_RSS_GROWTH, (
        f"operator RSS grew by {(peak - rss_before) / 2**20:.0f} MiB for {COUNT} InferenceServices")
    cluster.kubectl("delete", "-n", namespace, "pdis", "--all", "--wait=false")
