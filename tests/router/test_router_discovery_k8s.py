"""Kubernetes discovery against a real control plane (tests/operator/kubeenv.Cluster: etcd + kube-apiserver +
scheduler + kwok, whose simulated node turns pods Running/Ready with an IP; kwok stands in for the kubelet only).

The router's PodWatcher with the real KubePodSource (list + watch with a short server-side timeout, so re-watching is
exercised) must pick up pods that match the selector once they are Ready, with their role label and named port, and
drop pods that are deleted, within seconds.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.discovery import KubePodSource, PodWatcher
from pdserve.router.endpoints import EndpointPool

pytestmark = [pytest.mark.slow, pytest.mark.k8s]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.operator.kubeenv import Cluster, bin_dir

    c = Cluster(tmp_path_factory.mktemp("k8s-router"), bin_dir())
    try:
        c.start()
        yield c
    finally:
        c.stop()


def pod(name: str, role: str | None, app: str = "llm") -> dict:
    labels = {"app": app} | ({"pdserve.dev/role": role} if role else {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"nodeName": "kwok-node-0", "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "pdserve", "image": "pdserve:test",
                                     "ports": [{"name": "http", "containerPort": 8123}]}]}}


async def until(cond, timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.1)):
        if cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not reached in time")


async def test_pod_discovery_follows_the_api_server(cluster):
    ns = cluster.create_namespace(f"r-{uuid.uuid4().hex[:8]}")
    for p in (pod("dec-0", "decode"), pod("pre-0", "prefill"), pod("other", "decode", app="else")):
        r = cluster.http.post(f"/api/v1/namespaces/{ns}/pods", json=p)
        assert r.status_code == 201, r.text
    pool = EndpointPool()
    source = KubePodSource("app=llm", ns, watch_timeout=2, kubeconfig=str(cluster.kubeconfig))
    watcher = PodWatcher(RouterConfig(), pool, source, backoff=0.5)
    task = asyncio.create_task(watcher.run())
    try:
        await until(lambda: len(pool) == 2)
        roles = sorted((e.role, e.url.rsplit(":", 1)[1]) for e in pool)
        assert roles == [("decode", "8123"), ("prefill", "8123")]
        ips = {e.url.split("//")[1].split(":")[0] for e in pool}
        assert all(ip.startswith("127.77.") for ip in ips)             # kwok-assigned pod IPs (tests/operator/kubeenv.py)
        # joins: a new pod appears once Ready (after at least one watch timeout has passed)
        await asyncio.sleep(2.5)
        assert cluster.http.post(f"/api/v1/namespaces/{ns}/pods", json=pod("both-0", None)).status_code == 201
        await until(lambda: len(pool) == 3 and any(e.role == "both" for e in pool))
        # leaves: deleting a pod removes it
        assert cluster.http.delete(f"/api/v1/namespaces/{ns}/pods/dec-0",
                                   params={"gracePeriodSeconds": 0}).status_code == 200
        await until(lambda: sorted(e.role for e in pool) == ["both", "prefill"])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if source.api is not None:
            await source.api.api_client.close()
