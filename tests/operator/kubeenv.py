"""A real control plane for the operator tests: etcd + kube-apiserver + kube-controller-manager + kube-scheduler +
kwok (simulated nodes whose pods turn Running/Ready; the only fake: there is no kubelet or container runtime here).

Certificates, the service-account signing key and a static admin token are generated per session under a temporary
directory; everything binds 127.0.0.1 on free ports and is stopped (process group killed) at teardown.
"""

from __future__ import annotations

import os
import secrets
import signal
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.kube import ClusterProcesses, make_pki, write_kubeconfig  # noqa: F401 (re-exported)
from tests.support.server import free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "k8s-test-bins.sh"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "helm")
KWOK_NODE = "kwok-node-0"
# kwok gives pods IPs from this range; it is loopback so that a test can serve a pod's port itself (the autoscaler
# test binds <podIP>:8000 with a metrics server it controls). 127.0.0.0/8 is all routed to `lo` on Linux.
POD_CIDR = "127.77.0.1/16"
# Debian's etcd 3.4 lacks RequestWatchProgress, so the API server answers streaming watch-lists with an error watch;
# clients that use them by default would then only see changes on periodic re-lists (tens of seconds late).
NO_WATCH_LIST = ["--feature-gates", "WatchListClient=false"]


def bin_dir(build: bool = True) -> Path:
    """The cached binaries; builds them (first time: many minutes of Go compilation) when any is missing."""
    out = Path(subprocess.check_output(["bash", str(BUILD_SCRIPT), "--print"], text=True).strip())
    if build and not all((out / b).is_file() for b in BINARIES):
        subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, timeout=7200)
    return out


@dataclass
class Cluster(ClusterProcesses):
    workdir: Path
    bins: Path
    server: str = ""
    token: str = ""
    kubeconfig: Path = Path()
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    http: httpx.Client | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> Cluster:
        d = self.workdir
        make_pki(d, "pdserve-test-ca", "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc")
        self.token = secrets.token_hex(16)
        (d / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self._spawn("etcd", ["etcd", "--name", "test", "--data-dir", str(d / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
                             "--unsafe-no-fsync", "--quota-backend-bytes", str(2**31)])
        self.server = f"https://127.0.0.1:{api_port}"
        self._spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(api_port),
            "--cert-dir", str(d / "certs"), "--tls-cert-file", str(d / "apiserver.crt"),
            "--tls-private-key-file", str(d / "apiserver.key"), "--client-ca-file", str(d / "ca.crt"),
            "--token-auth-file", str(d / "tokens.csv"), "--authorization-mode", "RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc", "--api-audiences",
            "https://kubernetes.default.svc", "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"), "--service-cluster-ip-range", "10.96.0.0/16",
            "--allow-privileged=true", "--profiling=false", "--enable-priority-and-fairness=false", "--v", "1"])
        self.kubeconfig = write_kubeconfig(d / "admin.kubeconfig", self.server, d / "ca.crt", self.token)
        self.http = httpx.Client(base_url=self.server, verify=ssl.create_default_context(cafile=str(d / "ca.crt")),
                                 timeout=30,
                                 headers={"Authorization": f"Bearer {self.token}"})
        self._wait(lambda: self.http.get("/readyz").status_code == 200, 90, "kube-apiserver /readyz")
        kc = str(self.kubeconfig)
        self._spawn("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            # kwok's simulated node heartbeats come every ~20-45 s: a long grace period keeps the node Ready
            "--node-monitor-grace-period", "600s",
            "--leader-elect=false", "--controllers", "*", "--root-ca-file", str(d / "ca.crt"),
            "--service-account-private-key-file", str(d / "sa.key"), "--use-service-account-credentials=false",
            "--concurrent-deployment-syncs", "10", "--concurrent-replicaset-syncs", "10",
            "--concurrent-gc-syncs", "10", "--profiling=false", "--v", "1", *NO_WATCH_LIST])
        self._spawn("kube-scheduler", [
            str(self.bins / "kube-scheduler"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", str(free_port()),
            "--leader-elect=false", "--profiling=false", "--v", "1", *NO_WATCH_LIST])
        self._spawn("kwok", [
            str(self.bins / "kwok"), "--kubeconfig", kc, "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake", "--cidr", POD_CIDR,
            "--node-ip", "10.0.0.10", "--server-address", f"127.0.0.1:{free_port()}"])
        self._wait(lambda: self.http.get("/api/v1/namespaces/default/serviceaccounts/default").status_code == 200,
                   90, "default ServiceAccount (controller-manager running)")
        self.add_fake_node(KWOK_NODE)
        return self

    def stop(self) -> None:
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        if self.http:
            self.http.close()

    # -- helpers for tests -----------------------------------------------------------------------------------------
    def add_fake_node(self, name: str) -> None:
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                             "labels": {"type": "kwok", "kubernetes.io/hostname": name}},
                "status": {"allocatable": {"cpu": "1000", "memory": "4Ti", "pods": "1000", "nvidia.com/gpu": "64"},
                           "capacity": {"cpu": "1000", "memory": "4Ti", "pods": "1000", "nvidia.com/gpu": "64"}}}
        r = self.http.post("/api/v1/nodes", json=node)
        assert r.status_code in (201, 409), r.text

    def create_namespace(self, name: str) -> str:
        r = self.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": name}})
        assert r.status_code in (201, 409), r.text
        self._wait(lambda: self.get(f"/api/v1/namespaces/{name}/serviceaccounts/default") is not None, 60,
                   f"default ServiceAccount in {name}")
        return name

