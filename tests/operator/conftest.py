"""Session fixtures of the operator tests: a real control plane (kubeenv.Cluster), the Helm chart installed into it,
and `pdserve operator` running as a subprocess under the chart's least-privilege ServiceAccount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.operator.kubeenv import REPO, Cluster, bin_dir, write_kubeconfig
from tests.support.server import free_port

CHART = REPO / "charts" / "pdserve"
RELEASE, RELEASE_NS = "pdserve", "pdserve-system"
RESYNC_SECONDS = 10


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    c = Cluster(tmp_path_factory.mktemp("k8s"), bin_dir())
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def chart_release(cluster: Cluster) -> str:
    """`helm install` of charts/pdserve (operator Deployment, RBAC, CRD); returns the release namespace."""
    out = subprocess.run([str(cluster.bins / "helm"), "install", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                          "--create-namespace", "--kubeconfig", str(cluster.kubeconfig), "--wait", "--timeout", "3m"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    cluster.wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in cluster.get(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.pdserve.dev")["status"]
        ["conditions"]), 60, "CRD Established")
    return RELEASE_NS


@dataclass
class OperatorProcess:
    proc: subprocess.Popen
    log: Path
    liveness: str
    metrics: str  # the operator's own /metrics

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def operator(cluster: Cluster, chart_release: str, tmp_path_factory) -> OperatorProcess:
    """The operator, cluster-wide, authenticated as the chart's ServiceAccount (so its RBAC is what is tested)."""
    token = cluster.kubectl("create", "token", RELEASE, "-n", chart_release, "--duration", "4h").stdout.strip()
    d = tmp_path_factory.mktemp("operator")
    kubeconfig = write_kubeconfig(d / "kubeconfig", cluster.server, cluster.workdir / "ca.crt", token)
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    metrics_port = free_port()
    log = d / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "operator", "--resync-seconds", str(RESYNC_SECONDS),
                             "--liveness", liveness, "--log-format", "json", "--autoscale-tick-seconds", "0.5",
                             "--metrics", f"127.0.0.1:{metrics_port}"], cwd=d, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    handle = OperatorProcess(proc, log, liveness, f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        def alive() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited ({proc.returncode}):\n{handle.log_text()[-4000:]}")
            return httpx.get(liveness, timeout=2).status_code == 200
        cluster.wait_for(alive, 90, "operator liveness endpoint")
        yield handle
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = handle.log_text()
        print(f"\n--- operator log tail ---\n{text[-3000:]}")
        # Handlers must never crash (invalid specs are PermanentErrors, reported, not exceptions).
        crashes = [line for line in text.splitlines() if "failed with an exception" in line]
        assert not crashes, "operator handler crashed:\n" + "\n".join(crashes[:3])


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    return cluster.create_namespace(f"t-{uuid.uuid4().hex[:8]}")
