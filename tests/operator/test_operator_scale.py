"""Scale: 50 InferenceServices reconciled to their children and Ready; prints wall time and operator memory
(reported, never asserted)."""

from __future__ import annotations

import time

import psutil
import pytest
import yaml

from pdserve.operator import names

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

COUNT = 50



def test_fifty_inference_services(cluster, operator, namespace):
    docs = [{"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": f"m{i:02d}"},
             "spec": {"model": {"name": f"model-{i}"}, "runtime": {"kvCacheMemory": "64Mi"}}} for i in range(COUNT)]
    proc = psutil.Process(operator.proc.pid)
    rss_before = proc.memory_info().rss
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(yaml.safe_dump(d) for d in docs))

    def count(path: str) -> int:
        return len(cluster.get(path.format(ns=namespace) + f"?labelSelector={names.MANAGED_BY_LABEL}="
                               f"{names.MANAGED_BY}")["items"])

    # monolithic: decode + router Deployments, router + headless Services per InferenceService
    cluster.wait_for(lambda: count("/apis/apps/v1/namespaces/{ns}/deployments") == 2 * COUNT
                     and count("/api/v1/namespaces/{ns}/services") == 2 * COUNT
                     and count("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings") == COUNT,
                     300, f"children of {COUNT} InferenceServices", interval=1)
    t_children = time.monotonic() - t0

    def all_ready() -> bool:
        items = cluster.get(f"/apis/{names.API_VERSION}/namespaces/{namespace}/{names.PLURAL}")["items"]
        return len(items) == COUNT and all((i.get("status") or {}).get("phase") == "Ready" for i in items)
    cluster.wait_for(all_ready, 600, f"{COUNT} InferenceServices Ready", interval=2)
    t_ready = time.monotonic() - t0
    rss = proc.memory_info().rss
    print(f"\n[scale] {COUNT} InferenceServices: children in {t_children:.1f}s, all Ready in {t_ready:.1f}s; "
          f"operator RSS {rss_before / 2**20:.0f} MiB before -> {rss / 2**20:.0f} MiB after")
    assert operator.proc.poll() is None
    cluster.kubectl("delete", "-n", namespace, "pdis", "--all", "--wait=false")
