"""The autoscaler against a real kube-apiserver: kwok pods (loopback IPs, see kubeenv.POD_CIDR) whose /metrics are
served by real HTTP servers this test runs, each exposing a real runtime ServerMetrics the test feeds with load.

Load on prefill (slow TTFT) grows prefill only; load on decode (slow ITL) grows decode (through /scale); with no
load both come back down to minReplicas after the short scale-down window; Events and operator metrics say why."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.operator import names
from tests.operator.fakepods import FakePods
from tests.operator.test_operator_cluster import apply, example, isvc_path

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

AUTOSCALING = {
    "intervalSeconds": 1, "windowSeconds": 3,
    "prefill": {"minReplicas": 1, "maxReplicas": 3, "ttftP90Seconds": 1.0, "scaleUpStep": 1,
                "scaleDownStabilizationSeconds": 6},
    "decode": {"minReplicas": 1, "maxReplicas": 3, "itlP90Seconds": 0.05, "scaleUpStep": 1,
               "scaleDownStabilizationSeconds": 6},
}


def replicas(cluster, ns: str, role: str) -> int:
    return cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/auto-{role}")["spec"]["replicas"]


def events(cluster, ns: str, reason: str) -> list[str]:
    return [e["message"] for e in cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
            if e["involvedObject"].get("name") == "auto" and e["reason"] == reason]


@pytest.mark.parametrize("patch,message", [
    ({"prefill": {"minReplicas": 4, "maxReplicas": 2, "ttftP90Seconds": 1}}, "minReplicas must be <= maxReplicas"),
    ({"decode": {"maxReplicas": 2}}, "autoscaling needs at least one target"),
    ({"decode": {"maxReplicas": 2, "itlP90Seconds": 0}}, "spec.autoscaling.decode.itlP90Seconds"),
    ({"decode": {"maxReplicas": 2, "kvCacheUsage": 1.5}}, "spec.autoscaling.decode.kvCacheUsage"),
    ({"decode": {"minReplicas": 0, "maxReplicas": 2, "queueDepth": 4}}, "spec.autoscaling.decode.minReplicas"),
])
def test_autoscaling_schema_rejects_invalid(cluster, chart_release, namespace, patch, message):
    body = example()
    body["spec"]["autoscaling"] = patch
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    mono = example()
    del mono["spec"]["prefill"]
    mono["spec"]["autoscaling"] = {"prefill": {"maxReplicas": 2, "queueDepth": 1}}
    out = apply(cluster, namespace, mono, check=False)
    assert out.returncode != 0 and "autoscaling.prefill requires spec.prefill" in out.stderr, out.stderr


def test_replicas_follow_load_per_role_and_come_down_after_the_window(cluster, operator, namespace):
    body = example()
    body["metadata"]["name"] = "auto"
    body["spec"]["autoscaling"] = AUTOSCALING
    apply(cluster, namespace, yaml.safe_dump(body))
    pdbs = cluster.wait_for(lambda: (items := cluster.get(
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets?labelSelector={names.INSTANCE_LABEL}=auto"
    )["items"]) and len(items) == 3 and items, 60, "PodDisruptionBudgets")
    assert sorted(p["metadata"]["name"] for p in pdbs) == ["auto-decode", "auto-prefill", "auto-router"]
    with FakePods(cluster, namespace, "auto") as pods:
        # 1. slow TTFT with decode idle: prefill grows to its max step by step, decode stays
        pods.load["prefill"] = "busy"
        cluster.wait_for(lambda: replicas(cluster, namespace, "prefill") == 3, 90, "prefill scaled up to 3")
        assert replicas(cluster, namespace, "decode") == 1
        up = events(cluster, namespace, "ScaledUp")
        assert any(m.startswith("prefill 1 -> 2: ttft p90") for m in up), up
        assert not any(m.startswith("decode") for m in up), up
        # 2. slow ITL, prefill idle: decode grows (through /scale), prefill comes down after its window
        pods.load.update(prefill="idle", decode="busy")
        cluster.wait_for(lambda: replicas(cluster, namespace, "decode") >= 2, 90, "decode scaled up")
        assert any(m.startswith("decode 1 -> 2: itl p90") for m in events(cluster, namespace, "ScaledUp"))
        scale = cluster.get(isvc_path(namespace, "auto"))["metadata"]["managedFields"]
        assert any(f.get("subresource") == "scale" for f in scale), scale
        # 3. no load: both back to minReplicas, and only after the window
        t_idle = time.monotonic()
        pods.load["decode"] = "idle"
        cluster.wait_for(lambda: replicas(cluster, namespace, "prefill") == 1
                         and replicas(cluster, namespace, "decode") == 1, 120, "scaled down to min")
        assert time.monotonic() - t_idle >= 6  # the decode scale-down waited for its window
        down = events(cluster, namespace, "ScaledDown")
        assert any(m.startswith("prefill") and "idle" in m for m in down), down
        assert any(m.startswith("decode") and "idle" in m for m in down), down
        # and it stays there: no flapping while idle
        time.sleep(3)
        assert (replicas(cluster, namespace, "prefill"), replicas(cluster, namespace, "decode")) == (1, 1)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
        httpx.get(operator.metrics, timeout=5).text) for s in f.samples}
    for role in ("prefill", "decode"):
        key = (("isvc", "auto"), ("namespace", namespace), ("role", role))
        for direction in ("up", "down"):
            labels = tuple(sorted((*key, ("direction", direction))))
            assert samples[("pdserve_operator_autoscale_decisions_total", labels)] >= 1
        assert samples[("pdserve_operator_autoscale_desired_replicas", key)] == 1
