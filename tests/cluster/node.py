"""A real one-node Kubernetes cluster inside a private network namespace: etcd, kube-apiserver, controller-manager,
scheduler, containerd + runc, kubelet with a bridge CNI network, kube-proxy (iptables) and CoreDNS (as a node
process at the node address, which is the kubelet's clusterDNS). No simulated kubelet: pods are real containers.

Layout inside the namespace (see netns.py): the node is NODE_IP on a dummy interface, pods get 10.244.0.0/24 on the
bridge ``pdcni0``, Services 10.96.0.0/16. All state (containerd root, kubelet root, pod logs, CNI IPAM) lives under
one work directory. ``stop()`` deletes every pod first (so containerd tears down sandboxes, mounts and veths), then
stops the processes, unmounts anything left under the work directory and restores the kernel settings the kubelet
changes; deleting the namespace then removes the bridge and kube-proxy's iptables rules.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx

from tests.operator.kubeenv import NO_WATCH_LIST
from tests.support.kube import ClusterProcesses, make_pki, write_kubeconfig

NODE_NAME = "node-0"
NODE_IP = "10.199.0.1"
POD_SUBNET = "10.244.0.0/24"
SERVICE_RANGE = "10.96.0.0/16"
API_PORT = 6443
SHIM_RUN_DIR = Path("/run/containerd")
# Sysctls the kubelet sets on start (pkg/kubelet/cm setupKernelTunables); restored at stop.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def containerd_config(d: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/containerd/opt"
[{cri}]
  sandbox_image = "registry.k8s.io/pause:3.10"
  netns_mounts_under_state_dir = true
  # pods' oom_score_adj no lower than containerd's own: lowering it needs CAP_SYS_RESOURCE, which a test machine (itself
  # a container) may lack; runc then fails with "can't get final child's PID from pipe: EOF"
  restrict_oom_score_adj = true
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d}/cni"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d}/runc"
"""


def cni_config(d: Path) -> dict[str, Any]:
    return {"cniVersion": "0.4.0", "name": "pdserve-pods", "plugins": [
        {"type": "bridge", "bridge": "pdcni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]], "routes": [{"dst": "0.0.0.0/0"}],
                  "dataDir": str(d / "cni-ipam")}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}


def kubelet_config(d: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{d}/containerd.sock",
        # no QoS cgroup tree (nothing to leave behind in the host's cgroup v1 hierarchy); pods get runc's cgroups
        "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
        "failSwapOn": False, "clusterDNS": [NODE_IP], "clusterDomain": "cluster.local",
        "resolvConf": str(d / "resolv.conf"), "podLogsDir": str(d / "pod-logs"),
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # the shared disk and memory of a test machine must not make the kubelet evict the test's pods
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "serializeImagePulls": False, "hairpinMode": "hairpin-veth", "makeIPTablesUtilChains": False,
        "syncFrequency": "10s", "fileCheckFrequency": "10s",
    }


def kube_proxy_config(kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)}, "mode": "iptables", "hostnameOverride": NODE_NAME,
        "bindAddress": NODE_IP, "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
        "clusterCIDR": POD_SUBNET,
        # SNAT all Service traffic: replies then come back through the node, also for a pod reaching itself
        "iptables": {"masqueradeAll": True, "syncPeriod": "5s", "minSyncPeriod": "0s"},
        # conntrack limits are global kernel settings: leave them alone
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig: Path) -> str:
    return f""".:53 {{
    bind {NODE_IP}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


@dataclass
class NodeCluster(ClusterProcesses):
    """The cluster; ``start()`` inside the namespace (netns.network_namespace), ``stop()`` before leaving it."""

    POLL_INTERVAL: ClassVar[float] = 0.5

    workdir: Path
    bins: Path
    images: list[Path]
    server: str = f"https://{NODE_IP}:{API_PORT}"
    token: str = ""
    kubeconfig: Path = Path()
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    http: httpx.Client | None = None
    sysctls: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    cgroups: set[Path] = field(default_factory=set)
    run_dir_existed: bool = True

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> NodeCluster:
        d = self.workdir
        t0 = time.monotonic()
        make_pki(d, "pdserve-cluster-ca", f"IP:127.0.0.1,IP:{NODE_IP},IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
                 "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
        self.token = secrets.token_hex(16)
        (d / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        (d / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
        self.sysctls = {k: Path("/proc/sys", k).read_text().strip() for k in KUBELET_SYSCTLS}
        self.cgroups = top_cgroups()
        self.run_dir_existed = SHIM_RUN_DIR.exists()
        self._spawn("etcd", ["etcd", "--name", "node", "--data-dir", str(d / "etcd"),
                             "--listen-client-urls", "http://127.0.0.1:2379",
                             "--advertise-client-urls", "http://127.0.0.1:2379",
                             "--listen-peer-urls", "http://127.0.0.1:2380",
                             "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                             "--initial-cluster", "node=http://127.0.0.1:2380",
                             "--unsafe-no-fsync", "--quota-backend-bytes", str(2**31)])
        self._spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"), "--etcd-servers", "http://127.0.0.1:2379",
            "--bind-address", "0.0.0.0", "--advertise-address", NODE_IP, "--secure-port", str(API_PORT),
            "--cert-dir", str(d / "certs"), "--tls-cert-file", str(d / "apiserver.crt"),
            "--tls-private-key-file", str(d / "apiserver.key"), "--client-ca-file", str(d / "ca.crt"),
            "--token-auth-file", str(d / "tokens.csv"), "--authorization-mode", "RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc", "--api-audiences",
            "https://kubernetes.default.svc", "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"), "--service-cluster-ip-range", SERVICE_RANGE,
            "--allow-privileged=true", "--profiling=false", "--enable-priority-and-fairness=false", "--v", "1",
            # logs/exec reach the kubelet at NODE_IP, not by resolving the node's name through the machine's DNS
            "--kubelet-preferred-address-types", "InternalIP"])
        self.kubeconfig = write_kubeconfig(d / "admin.kubeconfig", self.server, d / "ca.crt", self.token)
        self.http = httpx.Client(base_url=self.server, verify=ssl.create_default_context(cafile=str(d / "ca.crt")),
                                 timeout=30, headers={"Authorization": f"Bearer {self.token}"})
        self._wait(lambda: self.http.get("/readyz").status_code == 200, 120, "kube-apiserver /readyz")
        kc = str(self.kubeconfig)
        self._spawn("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", "10257",
            "--leader-elect=false", "--controllers", "*", "--root-ca-file", str(d / "ca.crt"),
            "--service-account-private-key-file", str(d / "sa.key"), "--use-service-account-credentials=false",
            "--profiling=false", "--v", "1", *NO_WATCH_LIST])
        self._spawn("kube-scheduler", [
            str(self.bins / "kube-scheduler"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
            "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1", "--secure-port", "10259",
            "--leader-elect=false", "--profiling=false", "--v", "1", *NO_WATCH_LIST])
        self.timings["control_plane_s"] = time.monotonic() - t0

        (d / "containerd.toml").write_text(containerd_config(d))
        (d / "cni").mkdir()
        (d / "cni" / "10-pdserve.conflist").write_text(json.dumps(cni_config(d)))
        self._spawn("containerd", ["containerd", "--config", str(d / "containerd.toml")])
        self._wait(lambda: self.ctr("version", check=False).returncode == 0, 60, "containerd")
        for archive in self.images:
            self.import_image(archive)

        (d / "kubelet.yaml").write_text(json.dumps(kubelet_config(d)))
        self._spawn("kubelet", [str(self.bins / "kubelet"), "--config", str(d / "kubelet.yaml"), "--kubeconfig", kc,
                                "--root-dir", str(d / "kubelet"), "--cert-dir", str(d / "kubelet-pki"),
                                "--hostname-override", NODE_NAME, "--node-ip", NODE_IP, "--v", "1"])
        (d / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(self.kubeconfig)))
        self._spawn("kube-proxy", [str(self.bins / "kube-proxy"), "--config", str(d / "kube-proxy.yaml"), "--v", "1"])
        if (self.bins / "coredns").is_file():
            (d / "Corefile").write_text(corefile(self.kubeconfig))
            self._spawn("coredns", [str(self.bins / "coredns"), "-conf", str(d / "Corefile")])
        self.wait_for(self._node_ready, 180, f"node {NODE_NAME} Ready")
        self.wait_for(lambda: self.get("/api/v1/namespaces/default/serviceaccounts/default"), 90,
                      "default ServiceAccount")
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def import_image(self, archive: Path) -> None:
        """``ctr -n k8s.io images import`` of an OCI archive (unpacked for the CRI's snapshotter)."""
        t0 = time.monotonic()
        self.ctr("images", "import", str(archive), timeout=1800)
        self.timings[f"import {archive.name} s"] = round(time.monotonic() - t0, 1)

    def _node_ready(self) -> bool:
        node = self.get(f"/api/v1/nodes/{NODE_NAME}")
        return bool(node) and any(c["type"] == "Ready" and c["status"] == "True"
                                  for c in node["status"].get("conditions", []))

    def stop(self) -> None:
        """Pods first (the kubelet tears them down through containerd; the controllers are stopped so that no
        ReplicaSet replaces them), then the kubelet, whatever containers remain, the processes, the container
        processes still in the cluster's cgroups, mounts and cgroups; the kubelet's sysctls are restored in any case."""
        try:
            if self._running("kubelet") and self.http:
                self._terminate("kube-controller-manager", "kube-scheduler")  # nothing recreates deleted pods
                try:
                    for ns in self.get("/api/v1/namespaces")["items"]:
                        self.http.delete(f"/api/v1/namespaces/{ns['metadata']['name']}/pods",
                                         params={"gracePeriodSeconds": 0})
                    self.wait_for(lambda: not self.get("/api/v1/pods")["items"], 120, "every pod deleted",
                                  check_procs=False)
                    self.wait_for(lambda: not self.crictl_pods(), 120, "every sandbox removed", check_procs=False)
                except Exception as e:  # noqa: BLE001 - teardown goes on; leftovers are removed below
                    print(f"pod teardown: {e!r}")
            self._terminate("kubelet")
            if self._running("containerd"):
                self._remove_all_containers()
            self._terminate(*reversed(list(self.procs)))
            self._kill_shims()
            self._kill_cgroup_processes()
            for mount in self.mounts():
                subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
            for top in top_cgroups() - self.cgroups:  # only the cluster's own, emptied above
                for sub in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                    sub.rmdir()
                top.rmdir()
            if not self.run_dir_existed:  # containerd 1.6 keeps shim sockets there, whatever its config says
                with contextlib.suppress(OSError):
                    (SHIM_RUN_DIR / "s").rmdir()
                    SHIM_RUN_DIR.rmdir()
        finally:
            for key, value in self.sysctls.items():
                if Path("/proc/sys", key).read_text().strip() != value:
                    Path("/proc/sys", key).write_text(value)
            if self.http:
                self.http.close()

    def _running(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def _terminate(self, *names: str) -> None:
        for name in names:
            if self._running(name):
                os.killpg(self.procs[name].pid, signal.SIGTERM)
        for name in names:
            try:
                self.procs[name].wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.procs[name].pid, signal.SIGKILL)
                self.procs[name].wait(timeout=10)
            except KeyError:
                pass

    def _kill_cgroup_processes(self) -> None:
        """Container processes a killed shim left running, found in the cgroups only this cluster created."""
        for _ in range(20):
            pids = {int(p) for top in top_cgroups() - self.cgroups for f in top.rglob("cgroup.procs")
                    for p in f.read_text().split()}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)

    def _remove_all_containers(self) -> None:
        """Whatever the kubelet left: stop and delete every task and container containerd still holds."""
        ids = self.ctr("containers", "ls", "-q", check=False).stdout.split()
        for cid in ids:
            self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
        for cid in ids:
            self.ctr("tasks", "delete", "-f", cid, check=False)
            self.ctr("containers", "delete", cid, check=False)

    def _kill_shims(self) -> None:
        """containerd-shim processes of this cluster (they outlive containerd by design)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"containerd-shim-runc-v2") and str(self.workdir).encode() in b" ".join(cmd):
                os.kill(int(pid), signal.SIGKILL)

    def mounts(self) -> list[str]:
        """Mount points under the work directory (deepest first)."""
        prefix = str(self.workdir)
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        return sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True)

    # -- processes -------------------------------------------------------------------------------------------------
    def _spawn_env(self) -> dict[str, str]:
        env = super()._spawn_env()
        return {**env, "PATH": f"{env['PATH']}:/usr/sbin:/sbin"}

    # -- helpers for tests -----------------------------------------------------------------------------------------
    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(["ctr", "--address", str(self.workdir / "containerd.sock"), "-n", "k8s.io", *args],
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
        return out

    def crictl_pods(self) -> list[str]:
        """Sandbox containers containerd still holds (pause containers carry the CRI sandbox label)."""
        out = self.ctr("containers", "ls", "labels.\"io.cri-containerd.kind\"==sandbox", "-q", check=False)
        return out.stdout.split()

    def helm(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run([str(self.bins / "helm"), "--kubeconfig", str(self.kubeconfig), *args],
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
        return out


# First-level cgroups the cluster creates: containerd's CRI puts pods under /k8s.io when the kubelet runs without QoS
# cgroups (cgroupsPerQOS: false); the names the kubelet would use are listed too. Other processes of the machine make
# their own cgroups meanwhile: only these names are ever removed.
CLUSTER_CGROUPS = ("k8s.io", "kubepods", "kubepods.slice")


def top_cgroups() -> set[Path]:
    """The CLUSTER_CGROUPS that exist now, in every cgroup v1 controller."""
    root = Path("/sys/fs/cgroup")
    return {ctl / n for ctl in root.iterdir() if ctl.is_dir() for n in CLUSTER_CGROUPS if (ctl / n).is_dir()} \
        if root.is_dir() else set()


def leftovers(workdir: Path, cgroups: set[Path] | None = None) -> list[str]:
    """Processes whose command line names the work directory, mounts under it and first-level cgroups not in
    ``cgroups``: what a clean stop leaves none of."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                if str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(f"process {pid}")
            except OSError:
                pass
    prefix = str(workdir)
    found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
              if line.split()[4].startswith(prefix)]
    if cgroups is not None:
        found += [f"cgroup {p}" for p in sorted(top_cgroups() - cgroups)]
    return found


def tools_missing() -> list[str]:
    return [t for t in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip", "etcd", "openssl")
            if shutil.which(t) is None] + [p for p in ("/usr/lib/cni/bridge", "/usr/lib/cni/host-local")
                                           if not Path(p).exists()]
