"""The operator against a real kube-apiserver (+ controller-manager, scheduler, kwok nodes): apply, roll, repair,
reject, report, scale, delete. Pods are kwok-simulated (no kubelet here), which is why they turn Ready without
running the image."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.operator import names
from pdserve.operator.reconcile import Observed, reconcile

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "crds" / "examples" / "smollm2-pd.yaml"
OWNED = {"Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
         "Service": "/api/v1/namespaces/{ns}/services",
         "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
         "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
         "Secret": "/api/v1/namespaces/{ns}/secrets",
         "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
         "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"}


def isvc_path(ns: str, name: str = "") -> str:
    return f"/apis/{names.API_VERSION}/namespaces/{ns}/{names.PLURAL}" + (f"/{name}" if name else "")


def owned(cluster, ns: str, instance: str) -> dict[tuple[str, str], dict]:
    out = {}
    for kind, path in OWNED.items():
        items = cluster.get(path.format(ns=ns) + f"?labelSelector={names.INSTANCE_LABEL}={instance}")["items"]
        out.update({(kind, o["metadata"]["name"]): o for o in items})
    return out


def condition(body: dict, ctype: str) -> dict:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


def apply(cluster, ns: str, doc: dict | str, check: bool = True):
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=text, check=check)


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def wait_ready(cluster, ns: str, name: str, timeout: float = 120) -> dict:
    def ready():
        body = cluster.get(isvc_path(ns, name))
        ok = condition(body, "Ready").get("status") == "True"
        return body if ok and body["status"]["observedGeneration"] == body["metadata"]["generation"] else None
    return cluster.wait_for(ready, timeout, f"{ns}/{name} Ready")


def test_manifests_pass_server_side_validation(cluster, chart_release, namespace):
    """Every object the builders produce (for each example) and each example itself validate against the API
    server's OpenAPI schemas (server-side dry run, strict field validation: unknown fields fail too)."""
    for path in sorted((REPO / "crds" / "examples").glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(path))
        assert "(server dry run)" in out.stdout
        body["metadata"].update(namespace=namespace, uid="00000000-0000-0000-0000-000000000001", generation=1)
        result = reconcile(body, Observed())
        docs = "\n---\n".join(yaml.safe_dump(o) for o in result.objects + result.create_only)
        out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=docs)
        assert out.stdout.count("(server dry run)") == len(result.objects) + len(result.create_only), out.stdout


@pytest.mark.parametrize("patch,message", [
    ({"kvTransfer": {"connector": "redis"}}, "connector redis requires redis.url or redis.urlSecretRef"),
    ({"kvTransfer": {"connector": "disk"}}, "connector disk requires disk.claimName"),
    ({"kvTransfer": {"connector": "redis", "redis": {"url": "redis://a", "urlSecretRef": {"name": "s", "key": "k"}}}},
     "exactly one of url and urlSecretRef"),
    ({"decode": {"replicas": -1}}, "should be greater than or equal to 0"),
    ({"model": {"name": "m", "uri": "s3://bucket/x"}}, "spec.model.uri"),
    ({"kvTransfer": {"connector": "mooncake"}}, "Unsupported value: \"mooncake\""),
    ({"router": {"policy": "random"}}, "spec.router.policy"),
    ({"runtime": {"blockSize": 0}}, "spec.runtime.blockSize"),
    ({"runtime": {"gpuCount": 1}}, "unknown field \"spec.runtime.gpuCount\""),
])
def test_schema_and_cel_reject_invalid_specs(cluster, chart_release, namespace, patch, message):
    body = example()
    for key, value in patch.items():
        body["spec"][key] = value
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_name_rules_and_immutable_model_name(cluster, chart_release, namespace):
    body = example()
    body["metadata"]["name"] = "x" * 49
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and "at most 48 characters" in out.stderr
    body = example()
    body["metadata"]["name"] = "immutable"
    body["spec"]["decode"]["replicas"] = 0
    apply(cluster, namespace, body)
    body["spec"]["model"]["name"] = "renamed"
    out = apply(cluster, namespace, body, check=False)
    assert out.returncode != 0 and "model.name is immutable" in out.stderr


def test_example_reconciles_to_owned_children_and_ready(cluster, operator, namespace):
    apply(cluster, namespace, EXAMPLE.read_text())
    body = cluster.get(isvc_path(namespace, "smollm2"))
    expected = {("ConfigMap", "smollm2-config"), ("ServiceAccount", "smollm2-router"), ("Role", "smollm2-router"),
                ("RoleBinding", "smollm2-router"), ("Service", "smollm2-pods"), ("Service", "smollm2"),
                ("Deployment", "smollm2-prefill"), ("Deployment", "smollm2-decode"),
                ("Deployment", "smollm2-router"), ("Secret", "smollm2-kv-token")}
    children = cluster.wait_for(lambda: (c := owned(cluster, namespace, "smollm2")) and expected <= set(c) and c,
                                60, "children")
    assert set(children) == expected
    for obj in children.values():
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": names.API_VERSION, "kind": names.KIND, "name": "smollm2", "uid": body["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True}]
    # the router's RBAC really lets its ServiceAccount watch pods here, and nothing more
    sa = f"system:serviceaccount:{namespace}:smollm2-router"
    assert cluster.kubectl("auth", "can-i", "watch", "pods", "-n", namespace, "--as", sa).stdout.strip() == "yes"
    assert cluster.kubectl("auth", "can-i", "get", "secrets", "-n", namespace, "--as", sa,
                           check=False).stdout.strip() == "no"

    body = wait_ready(cluster, namespace, "smollm2")
    st = body["status"]
    assert st["phase"] == "Ready" and st["endpoint"] == f"http://smollm2.{namespace}.svc"
    assert (st["prefill"]["ready"], st["decode"]["ready"], st["router"]["ready"]) == ("1/1", "1/1", "1/1")
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Ready": "True", "PrefillReady": "True", "DecodeReady": "True", "RouterReady": "True"}
    pods = cluster.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={names.INSTANCE_LABEL}=smollm2")["items"]
    assert sorted(p["metadata"]["labels"][names.ROLE_LABEL] for p in pods) == ["decode", "prefill", "router"]
    table = cluster.kubectl("get", "pdis", "-n", namespace).stdout
    assert table.split()[:8] == ["NAME", "MODEL", "READY", "PREFILL", "DECODE", "ROUTER", "ENDPOINT", "AGE"]
    assert "smollm2-135m-instruct" in table and "1/1" in table


def test_spec_change_rolls_through_and_scale_subresource(cluster, operator, namespace):
    apply(cluster, namespace, EXAMPLE.read_text())
    wait_ready(cluster, namespace, "smollm2")
    body = example()
    body["spec"]["decode"]["replicas"] = 2
    body["spec"]["runtime"]["blockSize"] = 32
    apply(cluster, namespace, body)

    def rolled():
        dep = cluster.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/smollm2-decode")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return dep["spec"]["replicas"] == 2 and args[args.index("--block-size") + 1] == "32"
    cluster.wait_for(rolled, 60, "decode Deployment updated")
    st = wait_ready(cluster, namespace, "smollm2")["status"]
    assert st["decode"]["ready"] == "2/2" and st["observedGeneration"] == 2

    cluster.kubectl("scale", "-n", namespace, "pdis/smollm2", "--replicas=3")
    cluster.wait_for(lambda: cluster.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/smollm2-decode")
                     ["spec"]["replicas"] == 3, 60, "scaled via /scale")
    scale = cluster.get(isvc_path(namespace, "smollm2") + "/scale")
    assert scale["spec"]["replicas"] == 3
    cluster.wait_for(lambda: cluster.get(isvc_path(namespace, "smollm2") + "/scale")["status"].get("replicas") == 3,
                     60, "scale status")
    assert "pdserve.dev/role=decode" in cluster.get(isvc_path(namespace, "smollm2") + "/scale")["status"]["selector"]


def test_deleted_children_are_repaired(cluster, operator, namespace):
    apply(cluster, namespace, EXAMPLE.read_text())
    wait_ready(cluster, namespace, "smollm2")
    before = owned(cluster, namespace, "smollm2")
    for kind, name in (("Deployment", "smollm2-router"), ("Service", "smollm2"), ("ConfigMap", "smollm2-config"),
                       ("RoleBinding", "smollm2-router")):
        cluster.kubectl("delete", "-n", namespace, kind.lower(), name, "--wait=false")

    def repaired():
        now = owned(cluster, namespace, "smollm2")
        return all(k in now and now[k]["metadata"]["uid"] != before[k]["metadata"]["uid"] for k in
                   (("Deployment", "smollm2-router"), ("Service", "smollm2"), ("ConfigMap", "smollm2-config"),
                    ("RoleBinding", "smollm2-router")))
    cluster.wait_for(repaired, 60, "deleted children re-created")
    # a field the operator owns, edited by hand, is put back
    cluster.kubectl("patch", "-n", namespace, "deployment", "smollm2-prefill", "--type=merge",
                    "-p", '{"spec": {"replicas": 5}}')
    cluster.wait_for(lambda: cluster.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/smollm2-prefill")
                     ["spec"]["replicas"] == 1, 60, "drift repaired")
    wait_ready(cluster, namespace, "smollm2")


def test_switch_to_monolithic_prunes_prefill(cluster, operator, namespace):
    apply(cluster, namespace, EXAMPLE.read_text())
    wait_ready(cluster, namespace, "smollm2")
    body = example()
    del body["spec"]["prefill"]
    cluster.kubectl("replace", "-n", namespace, "-f", "-", input=yaml.safe_dump(
        {**body, "metadata": {**body["metadata"], "resourceVersion":
                              cluster.get(isvc_path(namespace, "smollm2"))["metadata"]["resourceVersion"]}}))

    def monolithic():
        deps = {k[1]: v for k, v in owned(cluster, namespace, "smollm2").items() if k[0] == "Deployment"}
        decode = deps.get("smollm2-decode")
        return ("smollm2-prefill" not in deps and decode is not None
                and decode["spec"]["selector"]["matchLabels"][names.ROLE_LABEL] == "both")
    cluster.wait_for(monolithic, 60, "prefill pruned, decode pool re-created as role both")
    st = wait_ready(cluster, namespace, "smollm2")["status"]
    assert "prefill" not in st
    assert condition(cluster.get(isvc_path(namespace, "smollm2")), "PrefillReady")["reason"] == "NotDisaggregated"


def test_invalid_spec_is_reported_not_crashlooped(cluster, operator, namespace):
    body = example()
    body["metadata"]["name"] = "bad"
    body["spec"]["runtime"]["kvCacheMemory"] = "lots"
    apply(cluster, namespace, body)

    def reported():
        b = cluster.get(isvc_path(namespace, "bad"))
        return b if condition(b, "Ready").get("reason") == "InvalidQuantity" else None
    b = cluster.wait_for(reported, 60, "InvalidQuantity condition")
    assert b["status"]["phase"] == "Failed" and "kvCacheMemory" in condition(b, "Ready")["message"]
    events = cluster.wait_for(lambda: [e for e in cluster.get(f"/api/v1/namespaces/{namespace}/events")["items"]
                                       if e["involvedObject"].get("name") == "bad"
                                       and e["reason"] == "InvalidQuantity"], 30, "Warning event")
    assert events[0]["type"] == "Warning" and "kvCacheMemory" in events[0]["message"]
    assert owned(cluster, namespace, "bad") == {}
    assert operator.proc.poll() is None
    # fixing the spec recovers without restarting anything
    body["spec"]["runtime"]["kvCacheMemory"] = "256Mi"
    apply(cluster, namespace, body)
    wait_ready(cluster, namespace, "bad")


def test_deleting_the_inference_service_removes_everything(cluster, operator, namespace):
    apply(cluster, namespace, EXAMPLE.read_text())
    cluster.wait_for(lambda: len(owned(cluster, namespace, "smollm2")) == 10, 60, "children")
    cluster.kubectl("delete", "-n", namespace, "pdis", "smollm2", "--wait=true", "--timeout=60s")
    cluster.wait_for(lambda: owned(cluster, namespace, "smollm2") == {}, 90, "garbage collection of every child")
    cluster.wait_for(lambda: not cluster.get(f"/api/v1/namespaces/{namespace}/pods")["items"], 90, "pods gone")


async def test_api_conflicts_are_retried_then_surface(cluster, chart_release, namespace, monkeypatch, caplog):
    """kube.Kube retries 409 conflicts with backoff and raises the last one; a 404 on delete is not an error."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from pdserve.operator.kube import ATTEMPTS, Kube

    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    kube = await Kube.connect()
    try:
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": namespace},
              "data": {"a": "1"}}
        await kube.apply(cm)
        stale = {**cm, "metadata": {**cm["metadata"], "resourceVersion": "1"}, "data": {"a": "2"}}
        with caplog.at_level("WARNING", logger="pdserve.operator.kube"), pytest.raises(ApiException) as e:
            await kube.apply(stale)
        assert e.value.status == 409
        assert len([r for r in caplog.records if "retrying PATCH" in r.message]) == ATTEMPTS - 1
        assert (await kube.get("ConfigMap", namespace, "c"))["data"] == {"a": "1"}
        await kube.delete("ConfigMap", namespace, "c")
        await kube.delete("ConfigMap", namespace, "c")  # already gone: fine
        assert await kube.get("ConfigMap", namespace, "c") is None
    finally:
        await kube.close()
