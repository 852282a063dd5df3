"""Generated artifacts checked without a cluster: CRD/RBAC drift, CRD structure, examples, the operator's CLI flags.
The image recipe is checked in test_dockerfile.py (and built and run by tests/cluster/test_cluster_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.operator import crdgen
from pdserve.operator.reconcile import Observed, reconcile

REPO = Path(__file__).resolve().parents[2]


def test_generated_files_match_the_models():
    for path, text in crdgen.render().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run python -m pdserve.operator.crdgen"
    out = subprocess.run([sys.executable, "-m", "pdserve.operator.crdgen", "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_drift_check_fails_on_a_changed_copy(tmp_path, monkeypatch):
    stale = tmp_path / "inferenceservice.yaml"
    stale.write_text(crdgen.render()[crdgen.CRD_OUTPUTS[0]].replace("minimum: 0", "minimum: 1"))
    monkeypatch.setattr(crdgen, "CRD_OUTPUTS", (stale,))
    monkeypatch.setattr(crdgen, "REPO", tmp_path)
    assert crdgen.main(["--check"]) == 1
    assert crdgen.main([]) == 0 and crdgen.main(["--check"]) == 0


def _walk(schema, path="$"):
    yield path, schema
    for key in ("properties",):
        for name, sub in schema.get(key, {}).items():
            yield from _walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _walk(schema[key], f"{path}[{key}]")


def test_crd_schema_is_structural_and_has_the_rules():
    crd = crdgen.build_crd()
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert "$ref" not in node and "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
    spec = root["properties"]["spec"]["properties"]
    assert spec["model"]["properties"]["name"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert spec["decode"]["properties"]["replicas"]["minimum"] == 0
    assert spec["decode"]["default"] == {} and spec["decode"]["properties"]["replicas"]["default"] == 1
    kv_rules = [r["rule"] for r in spec["kvTransfer"]["x-kubernetes-validations"]]
    assert kv_rules == ["self.connector != 'redis' || has(self.redis)", "self.connector != 'disk' || has(self.disk)"]
    assert spec["kvTransfer"]["properties"]["connector"]["enum"] == ["nixl", "redis", "disk"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model", "Ready", "Prefill", "Decode", "Router", "Endpoint", "Age"]
    assert crd["spec"]["names"]["shortNames"] == ["pdis"]


def expected_children(name: str, disaggregated: bool) -> set[tuple[str, str]]:
    """What one InferenceService owns: a router (ServiceAccount + Role + RoleBinding for pod discovery, Deployment, PDB),
    the client Service and the headless pod Service, the shared ConfigMap, and a Deployment + PDB per engine pool."""
    pools = ["decode", "router"] + (["prefill"] if disaggregated else [])
    return ({("ConfigMap", f"{name}-config"), ("Service", name), ("Service", f"{name}-pods")}
            | {(kind, f"{name}-router") for kind in ("ServiceAccount", "Role", "RoleBinding")}
            | {(kind, f"{name}-{pool}") for pool in pools for kind in ("Deployment", "PodDisruptionBudget")})


# example -> (InferenceService name, has a prefill pool); a new example needs its line here
EXAMPLES = {"gpu-disk.yaml": ("llama-8b", True), "smollm2-autoscaled.yaml": ("smollm2-auto", True),
            "smollm2-monolithic.yaml": ("smollm2-mono", False), "smollm2-pd.yaml": ("smollm2", True)}


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "crds" / "examples").glob("*.yaml")))
def test_examples_reconcile(example):
    # the exact set of children: a dropped PDB, RBAC object or prefill pool fails here (a count of >= 8 did not)
    body = yaml.safe_load((REPO / "crds" / "examples" / example).read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    result = reconcile(body, Observed())
    assert result.error is None
    objects = [(o["kind"], o["metadata"]["name"]) for o in result.objects]
    assert len(objects) == len(set(objects)), f"an object rendered twice: {objects}"
    assert set(objects) == expected_children(*EXAMPLES[example])
    for o in result.objects:   # each in the InferenceService's namespace and owned by it (garbage-collected with it)
        assert o["metadata"]["namespace"] == "ns" and [r["uid"] for r in o["metadata"]["ownerReferences"]] == ["u"], o


def test_operator_cli_flags():
    from pdserve.cli import build_parser

    argv = ["operator", "-n", "team-a", "--namespace", "team-b", "--resync-seconds", "5", "--liveness", "none"]
    args = build_parser(argv).parse_args(argv)
    assert (args.namespace, args.resync_seconds, args.liveness, args.log_format) == (["team-a", "team-b"], 5.0,
                                                                                     "none", "json")
    assert args.func.__module__ == "pdserve.operator.cli"
    with pytest.raises(SystemExit):
        build_parser(["operator", "-A", "-n", "x"]).parse_args(["operator", "-A", "-n", "x"])
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "operator", "--help"], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0 and "--resync-seconds" in out.stdout
