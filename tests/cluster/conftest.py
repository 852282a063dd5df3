"""Fixtures of the one-node cluster tests: the real image (scripts/build-image.sh), the node binaries
(scripts/k8s-test-bins.sh --node) and a NodeCluster inside a private network namespace.

Building the inputs takes long (a multi-GB image, kubelet/kube-proxy/CoreDNS from Go sources), so a plain `pytest`
run uses them only when they are cached and otherwise skips, naming the command that builds them: `make test-cluster`
(which sets PDSERVE_CLUSTER_BUILD=1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.cluster.netns import network_namespace
from tests.cluster.node import NODE_IP, NodeCluster, leftovers, tools_missing, top_cgroups
from tests.operator.kubeenv import BUILD_SCRIPT, REPO

IMAGE_SCRIPT = REPO / "scripts" / "build-image.sh"
PAUSE_SCRIPT = REPO / "scripts" / "cluster" / "pause-image.sh"
NODE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy",
                 "coredns")
BUILD = os.environ.get("PDSERVE_CLUSTER_BUILD") == "1"


def _script(path: Path, *args: str, timeout: float = 10) -> Path:
    return Path(subprocess.check_output(["bash", str(path), *args], text=True, timeout=timeout).strip())


def _missing_or_build(paths: list[Path], build: list[list[str]]) -> None:
    missing = [str(p) for p in paths if not p.is_file()]
    if missing and not BUILD:
        pytest.skip(f"cluster inputs not built (run `make test-cluster`): missing {', '.join(missing)}")
    for cmd in build if missing else []:
        subprocess.run(cmd, check=True, timeout=4 * 3600)


# Module scope: the fixture keeps this process inside the node's network namespace while the cluster runs, which must
# not outlast the cluster tests when they run within the whole suite (a fresh node starts in ~10 s).
@pytest.fixture(scope="module")
def node_cluster() -> NodeCluster:
    """The running node (its pod sandbox image imported); skips when not root, tools or node binaries are missing."""
    if os.geteuid() != 0:
        pytest.skip("the one-node cluster needs root (network namespaces, containerd, kubelet)")
    if missing := tools_missing():
        pytest.skip(f"missing node tools: {', '.join(missing)} (Debian: containerd runc containernetworking-plugins "
                    "iptables etcd-server)")
    bins = _script(BUILD_SCRIPT, "--print")
    pause = _script(PAUSE_SCRIPT, "--print")
    _missing_or_build([bins / b for b in NODE_BINARIES] + [pause],
                      [["bash", str(BUILD_SCRIPT), "--node"], ["bash", str(PAUSE_SCRIPT)]])
    # Not under pytest's basetemp: pytest sessions running beside this one rotate old basetemps away, which would
    # delete a running cluster's sockets and state.
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-node-"))
    cgroups = top_cgroups()
    with network_namespace(f"pdserve-{uuid.uuid4().hex[:8]}", f"{NODE_IP}/24"):
        cluster = NodeCluster(workdir, bins, [pause])
        try:
            cluster.start()
            print(f"\ncluster timings: {cluster.timings}")
            yield cluster
        finally:
            cluster.stop()
            left = leftovers(workdir, cgroups)
    assert not left, f"the cluster left behind: {left} (work directory {workdir} kept)"
    shutil.rmtree(workdir)


@pytest.fixture(scope="module")
def pdserve_image(node_cluster: NodeCluster) -> str:
    """The image built from the Dockerfile (scripts/build-image.sh), imported into the node's containerd."""
    archive = _script(IMAGE_SCRIPT, "--print", timeout=60)
    _missing_or_build([archive, node_cluster.bins / "helm"], [["bash", str(IMAGE_SCRIPT)], ["bash", str(BUILD_SCRIPT)]])
    node_cluster.import_image(archive)
    return archive.name
