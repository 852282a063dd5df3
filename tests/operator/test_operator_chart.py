"""charts/pdserve: `helm lint` and `helm template` clean, values schema enforced, RBAC equal to operator/rbac.py,
and `helm install` into the real API server creates the operator Deployment, its RBAC and the CRD."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.operator import crdgen, rbac
from pdserve.operator.reconcile import Observed, reconcile
from tests.operator.kubeenv import bin_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdserve"


@pytest.fixture(scope="module")
def helm() -> str:
    return str(bin_dir() / "helm")


def template(helm: str, *args: str, check: bool = True) -> list[dict] | subprocess.CompletedProcess:
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "ops", *args], capture_output=True,
                         text=True, timeout=120)
    if not check:
        return out
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kinds(docs: list[dict]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"].get("namespace", "")) for d in docs)


def test_helm_lint_is_clean(helm):
    out = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_template_cluster_wide(helm):
    docs = template(helm, "--include-crds")
    assert kinds(docs) == [("ClusterRole", ""), ("ClusterRoleBinding", ""), ("CustomResourceDefinition", ""),
                           ("Deployment", "ops"), ("ServiceAccount", "ops")]
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd == crdgen.build_crd()
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == rbac.CLUSTER_RULES + rbac.NAMESPACED_RULES
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/pdserve/pdserve:0.1.0" and c["args"][0] == "operator"
    assert not any(a.startswith("--namespace") for a in c["args"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_template_namespaced(helm):
    docs = template(helm, "--set", "operator.watchNamespaces={team-a,team-b}")
    assert kinds(docs) == [("ClusterRole", ""), ("ClusterRoleBinding", ""), ("Deployment", "ops"),
                           ("Role", "team-a"), ("Role", "team-b"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b"),
                           ("ServiceAccount", "ops")]
    assert next(d for d in docs if d["kind"] == "ClusterRole")["rules"] == rbac.CLUSTER_RULES
    for role in (d for d in docs if d["kind"] == "Role"):
        assert role["rules"] == rbac.NAMESPACED_RULES
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_template_example_inference_service(helm):
    docs = template(helm, "--set", "example.enabled=true", "--set", "image.tag=1.2.3")
    isvc = next(d for d in docs if d["kind"] == "InferenceService")
    assert isvc["spec"]["runtime"]["image"] == "ghcr.io/pdserve/pdserve:1.2.3"
    isvc["metadata"].update(uid="u", generation=1)
    assert reconcile(isvc, Observed()).error is None


@pytest.mark.parametrize("args,message", [
    (["--set", "operator.resyncSeconds=0"], "resyncSeconds"),
    (["--set", "bogus=1"], "bogus"),
    (["--set", "operator.logFormat=xml"], "logFormat"),
    (["--set", "operator.watchNamespaces={Bad_NS}"], "watchNamespaces"),
])
def test_values_schema_rejects(helm, args, message):
    out = template(helm, *args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.k8s
@pytest.mark.slow
def test_helm_install_creates_operator_and_crd(cluster, chart_release):
    ns = chart_release
    assert cluster.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.pdserve.dev")
    assert cluster.get(f"/api/v1/namespaces/{ns}/serviceaccounts/pdserve")
    assert cluster.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/pdserve")["rules"] == (
        rbac.CLUSTER_RULES + rbac.NAMESPACED_RULES)
    dep = cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/pdserve")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "pdserve"
    # kwok runs the pod (no kubelet here): the Deployment becomes available like on a real node
    cluster.wait_for(lambda: cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/pdserve")
                     .get("status", {}).get("availableReplicas") == 1, 90, "operator Deployment available")
    listed = cluster.kubectl("get", "crd", "inferenceservices.pdserve.dev", "-o", "name").stdout.strip()
    assert listed == "customresourcedefinition.apiextensions.k8s.io/inferenceservices.pdserve.dev"
