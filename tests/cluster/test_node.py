"""The one-node cluster itself (no pdserve image needed): a pod runs as a real container, non-root on a read-only root
filesystem as the operator's pods do, gets an address on the pod bridge; Services work through kube-proxy's iptables
rules and CoreDNS answers for them; the fixture's teardown then asserts nothing is left behind."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import struct

import httpx
import pytest

from tests.cluster.node import NODE_IP, POD_SUBNET, NodeCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]


def dns_a(server: str, name: str) -> tuple[int, list[str]]:
    """(rcode, A records) of ``name`` from ``server`` (one plain UDP query; no resolver library needed)."""
    query = struct.pack(">HHHHHH", 0x1D2B, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(query, (server, 53))
        reply = s.recv(4096)
    rcode, answers, pos = reply[3] & 0xF, struct.unpack(">H", reply[6:8])[0], len(query)
    out = []
    for _ in range(answers):
        while reply[pos] and reply[pos] < 0xC0:  # the owner name: labels, ending in 0 or a compression pointer
            pos += 1 + reply[pos]
        pos += 2 if reply[pos] else 1
        rtype, _, _, length = struct.unpack(">HHIH", reply[pos:pos + 10])
        pos += 10
        if rtype == 1:
            out.append(socket.inet_ntoa(reply[pos:pos + length]))
        pos += length
    return rcode, out


def test_pod_runs_non_root_read_only_and_services_resolve(node_cluster: NodeCluster):
    c = node_cluster
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sandbox-check"}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "imagePullPolicy": "Never",
                        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}}]}}
    assert c.http.post("/api/v1/namespaces/default/pods", json=pod).status_code == 201
    running = c.wait_for(lambda: (p := c.get("/api/v1/namespaces/default/pods/sandbox-check"))
                         and p["status"].get("phase") == "Running" and p, 180, "pod Running")
    assert ipaddress.ip_address(running["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
    # the apiserver through the `kubernetes` Service's ClusterIP (kube-proxy DNAT to NODE_IP:6443)
    svc = c.get("/api/v1/namespaces/default/services/kubernetes")["spec"]["clusterIP"]
    ca = ssl.create_default_context(cafile=str(c.workdir / "ca.crt"))
    r = c.wait_for(lambda: httpx.get(f"https://{svc}/readyz", verify=ca, timeout=5), 60,
                   "the kubernetes Service through kube-proxy")
    assert r.status_code == 200
    # CoreDNS at the kubelet's clusterDNS address (answers once its informers synced)
    assert c.wait_for(lambda: dns_a(NODE_IP, "kubernetes.default.svc.cluster.local") == (0, [svc]), 60,
                      "CoreDNS answers for the kubernetes Service")
    c.kubectl("delete", "pod", "sandbox-check", "--wait=true", timeout=120)
