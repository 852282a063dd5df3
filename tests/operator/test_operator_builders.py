"""Pure builders and reconcile on plain dicts (no API server): hand-checked objects, args, volumes and status."""

from __future__ import annotations

import copy
import datetime as dt
import json

import pytest

from pdserve.operator import names
from pdserve.operator.pod import InvalidSpec, parse_bytes
from pdserve.operator.reconcile import Observed, parse_spec, reconcile

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def isvc(spec: dict, name: str = "m", generation: int = 1, status: dict | None = None) -> dict:
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": generation},
            "spec": spec}
    if status is not None:
        body["status"] = status
    return body


def by_name(result, kind: str, name: str) -> dict:
    return next(o for o in result.objects if o["kind"] == kind and o["metadata"]["name"] == name)


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def kv_config(dep: dict) -> dict:
    args = container(dep)["args"]
    return json.loads(args[args.index("--kv-connector-config") + 1])


def env_of(dep: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(dep)["env"]}


PD = {"model": {"name": "smol"}, "prefill": {"replicas": 2}, "decode": {"replicas": 3}}


def test_monolithic_objects_and_exact_serve_args():
    r = reconcile(isvc({"model": {"name": "smol"}}), Observed(), NOW)
    assert r.error is None and r.prune == []
    assert [(o["kind"], o["metadata"]["name"]) for o in r.objects] == [
        ("ConfigMap", "m-config"), ("ServiceAccount", "m-router"), ("Role", "m-router"), ("RoleBinding", "m-router"),
        ("Service", "m-pods"), ("Deployment", "m-decode"), ("Deployment", "m-router"), ("Service", "m"),
        ("PodDisruptionBudget", "m-decode"), ("PodDisruptionBudget", "m-router")]
    assert [(o["kind"], o["metadata"]["name"]) for o in r.create_only] == [("Secret", "m-kv-token")]
    dep = by_name(r, "Deployment", "m-decode")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": "m",
        "app.kubernetes.io/component": "runtime", "pdserve.dev/role": "both"}
    # NIXL has no peer in a monolithic pool: no connector flags, no nixl port
    assert container(dep)["args"] == [
        "serve", "--host", "0.0.0.0", "--port", "8000", "--role", "both", "--served-model-name", "smol",
        "--block-size", "16", "--kv-cache-memory", str(2**30), "--dtype", "auto",
        "--kv-events-port", "5557", "--kv-events-replay-port", "5558", "--kv-events-host", "$(POD_IP)"]
    assert [p["name"] for p in container(dep)["ports"]] == ["http", "kv-events", "kv-replay"]
    assert container(dep)["image"] == names.DEFAULT_IMAGE


def test_every_object_is_owned_and_labelled():
    body = isvc(PD)
    r = reconcile(body, Observed(), NOW)
    for obj in r.objects + r.create_only:
        assert obj["metadata"]["namespace"] == "ns"
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "pdserve.dev/v1alpha1", "kind": "InferenceService",
                                                       "name": "m", "uid": "uid-1", "controller": True,
                                                       "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"][names.INSTANCE_LABEL] == "m"
        assert obj["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY


def test_disaggregated_pools_nixl_and_probes():
    r = reconcile(isvc(PD), Observed(), NOW)
    prefill, decode = by_name(r, "Deployment", "m-prefill"), by_name(r, "Deployment", "m-decode")
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    for dep, role in ((prefill, "prefill"), (decode, "decode")):
        c = container(dep)
        args = c["args"]
        assert args[args.index("--role") + 1] == role
        assert args[args.index("--kv-connector") + 1] == "nixl"
        # the kubelet expands $(POD_IP) (defined first in env) when it starts the container
        assert kv_config(dep) == {"host": "$(POD_IP)", "port": 5600, "advertise_host": "$(POD_IP)"}
        assert c["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        assert {"name": "nixl", "containerPort": 5600} in c["ports"]
        assert c["envFrom"] == [{"configMapRef": {"name": "m-config"}}]
        assert env_of(dep)["PDSERVE_KV_TOKEN"] == {"secretKeyRef": {"name": "m-kv-token", "key": "token"}}
        assert dep["spec"]["template"]["metadata"]["labels"][names.ROLE_LABEL] == role
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        pod = dep["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 60 and pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
    cm = by_name(r, "ConfigMap", "m-config")
    assert cm["data"] == {"PDSERVE_HASH_SEED": "pdserve", "PDSERVE_CACHE_DIR": "/cache/pdserve",
                          "PDSERVE_LOG_LEVEL": "INFO"}
    headless = by_name(r, "Service", "m-pods")
    assert headless["spec"]["clusterIP"] == "None"
    assert names.ROLE_LABEL not in headless["spec"]["selector"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [8000, 5557, 5558, 5600]


def test_router_deployment_rbac_and_service():
    spec = {**PD, "router": {"replicas": 2, "policy": "least-loaded", "pdThreshold": 64, "port": 8080,
                             "serviceType": "LoadBalancer", "apiKeySecretRef": {"name": "k", "key": "key"}}}
    r = reconcile(isvc(spec), Observed(), NOW)
    dep = by_name(r, "Deployment", "m-router")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "m-router"
    assert container(dep)["args"] == [
        "router", "--host", "0.0.0.0", "--port", "8080",
        "--discover", "app.kubernetes.io/name=pdserve,app.kubernetes.io/instance=m,pdserve.dev/role in (both,decode,prefill)",
        "--namespace", "ns", "--role-label", "pdserve.dev/role", "--policy", "least-loaded", "--pd-threshold", "64",
        "--block-size", "16", "--kv-events-port", "5557", "--kv-events-replay-port", "5558",
        "--api-key", "$(PDSERVE_API_KEY)"]
    assert env_of(dep) == {"PDSERVE_API_KEY": {"secretKeyRef": {"name": "k", "key": "key"}},
                           # the KV secret signs the router's handoffs to prefill pods
                           "PDSERVE_KV_TOKEN": {"secretKeyRef": {"name": "m-kv-token", "key": "token"}}}
    assert container(dep)["envFrom"] == [{"configMapRef": {"name": "m-config"}}]
    role = by_name(r, "Role", "m-router")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = by_name(r, "RoleBinding", "m-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "m-router", "namespace": "ns"}]
    svc = by_name(r, "Service", "m")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"][names.ROLE_LABEL] == "router"
    assert r.status["endpoint"] == "http://m.ns.svc:8080"


def test_pool_overrides_replace_fields_and_append_env():
    spec = {"model": {"name": "smol"},
            "runtime": {"image": "img:1", "blockSize": 32, "env": [{"name": "A", "value": "1"}],
                        "resources": {"limits": {"cpu": 4}}, "nodeSelector": {"pool": "cpu"}},
            "prefill": {"replicas": 1, "image": "img:prefill", "blockSize": 64},
            "decode": {"replicas": 1, "env": [{"name": "B", "value": "2"}], "resources": {"limits": {"cpu": "8"}},
                       "maxModelLen": 4096, "extraArgs": ["--max-num-seqs", "8"]}}
    r = reconcile(isvc(spec), Observed(), NOW)
    prefill, decode = container(by_name(r, "Deployment", "m-prefill")), container(by_name(r, "Deployment", "m-decode"))
    assert prefill["image"] == "img:prefill" and decode["image"] == "img:1"
    assert prefill["args"][prefill["args"].index("--block-size") + 1] == "64"
    assert decode["args"][decode["args"].index("--block-size") + 1] == "32"
    assert decode["args"][decode["args"].index("--max-model-len") + 1] == "4096" and "--max-model-len" not in prefill["args"]
    assert decode["args"][-2:] == ["--max-num-seqs", "8"] and "--max-num-seqs" not in prefill["args"]
    assert [e["name"] for e in decode["env"]][-2:] == ["A", "B"]
    assert [e["name"] for e in prefill["env"]][-1] == "A"
    assert prefill["resources"] == {"limits": {"cpu": "4"}} and decode["resources"] == {"limits": {"cpu": "8"}}
    assert by_name(r, "Deployment", "m-decode")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}


def test_disk_connector_mounts_the_claim():
    spec = {**PD, "kvTransfer": {"connector": "disk", "disk": {"claimName": "kv", "path": "a/b"}}}
    r = reconcile(isvc(spec), Observed(), NOW)
    dep = by_name(r, "Deployment", "m-prefill")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "kv", "persistentVolumeClaim": {"claimName": "kv"}} in pod["volumes"]
    assert {"name": "kv", "mountPath": "/kv"} in container(dep)["volumeMounts"]
    assert kv_config(dep) == {"path": "/kv/a/b"}
    assert "nixl" not in [p["name"] for p in container(dep)["ports"]]


def test_runtime_api_key_only_through_env():
    spec = {"model": {"name": "smol"}, "runtime": {"apiKeySecretRef": {"name": "k", "key": "key"}}}
    dep = by_name(reconcile(isvc(spec), Observed(), NOW), "Deployment", "m-decode")
    assert env_of(dep)["PDSERVE_API_KEY"] == {"secretKeyRef": {"name": "k", "key": "key"}}
    assert "--api-key" not in container(dep)["args"]


def test_redis_url_from_secret_goes_through_env():
    spec = {"model": {"name": "smol"}, "kvTransfer": {"connector": "redis",
                                                       "redis": {"urlSecretRef": {"name": "r", "key": "url"}}}}
    r = reconcile(isvc(spec), Observed(), NOW)
    dep = by_name(r, "Deployment", "m-decode")  # monolithic pods share a Redis store, so they get the connector
    assert kv_config(dep) == {"url": "$(PDSERVE_REDIS_URL)"}  # the URL itself never enters the pod spec
    assert env_of(dep)["PDSERVE_REDIS_URL"] == {"secretKeyRef": {"name": "r", "key": "url"}}
    args = container(dep)["args"]
    assert args[args.index("--kv-connector") + 1] == "redis"
    plain = {"model": {"name": "smol"}, "kvTransfer": {"connector": "redis", "redis": {"url": "redis://r:6379"}}}
    dep = by_name(reconcile(isvc(plain), Observed(), NOW), "Deployment", "m-decode")
    assert kv_config(dep) == {"url": "redis://r:6379"} and "PDSERVE_REDIS_URL" not in env_of(dep)


@pytest.mark.parametrize("uri,model_args,mount", [
    ("default", [], None),
    ("hf://org/name", ["--model", "org/name"], None),
    ("/opt/models/smol", ["--model", "/opt/models/smol"], None),
    ("pvc://weights/llama/8b", ["--model", "/models/weights/llama/8b"], "/models/weights"),
])
def test_model_uri(uri, model_args, mount):
    spec = {"model": {"name": "smol", "uri": uri, "authSecretRef": {"name": "hf", "key": "token"}}}
    dep = by_name(reconcile(isvc(spec), Observed(), NOW), "Deployment", "m-decode")
    args = container(dep)["args"]
    assert args[1:1 + len(model_args)] == model_args and (model_args or "--model" not in args)
    mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
    if mount:
        assert mounts["model"] == {"name": "model", "mountPath": mount, "readOnly": True}
        claim = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
        assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    else:
        assert "model" not in mounts
    assert env_of(dep)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}


@pytest.mark.parametrize("value,expected", [
    (1234, 1234), ("1234", 1234), ("2Gi", 2 * 2**30), ("500M", 500 * 10**6), ("1e9", 10**9), ("1.5Gi", 3 * 2**29),
    ("64Ki", 65536)])
def test_parse_bytes(value, expected):
    assert parse_bytes(value, "f") == expected


@pytest.mark.parametrize("value", ["lots", "2GB", "-1", "1.2.3Mi", ""])
def test_parse_bytes_rejects(value):
    with pytest.raises(InvalidSpec) as e:
        parse_bytes(value, "kvCacheMemory")
    assert e.value.reason == "InvalidQuantity" and "kvCacheMemory" in str(e.value)


def test_invalid_spec_reports_instead_of_building():
    r = reconcile(isvc({"model": {"name": "smol"}, "runtime": {"kvCacheMemory": "lots"}}), Observed(), NOW)
    assert r.objects == [] and r.create_only == [] and r.prune == [] and r.error.reason == "InvalidQuantity"
    assert r.status["phase"] == "Failed"
    assert r.status["conditions"][0] | {"message": ""} == {
        "type": "Ready", "status": "False", "reason": "InvalidQuantity", "message": "",
        "lastTransitionTime": "2026-01-02T03:04:05Z", "observedGeneration": 1}
    with pytest.raises(InvalidSpec, match="spec.decode.replicas"):
        parse_spec(isvc({"model": {"name": "smol"}, "decode": {"replicas": -1}}))


def deployment_status(r, name: str, ready: int, generation: int = 1) -> dict:
    dep = copy.deepcopy(by_name(r, "Deployment", name))
    dep["metadata"]["generation"] = generation
    want = dep["spec"]["replicas"]
    dep["status"] = {"observedGeneration": generation, "replicas": want, "updatedReplicas": want,
                     "readyReplicas": ready}
    return dep


def test_status_follows_the_deployments():
    body = isvc(PD)
    r0 = reconcile(body, Observed(), NOW)
    assert r0.status["phase"] == "Pending"
    assert {c["type"]: c["reason"] for c in r0.status["conditions"]} == {
        "Ready": "DeploymentMissing", "PrefillReady": "DeploymentMissing", "DecodeReady": "DeploymentMissing",
        "RouterReady": "DeploymentMissing"}
    deps = {n: deployment_status(r0, n, ready) for n, ready in (("m-prefill", 2), ("m-decode", 1), ("m-router", 1))}
    r1 = reconcile(body, Observed(deployments=deps), NOW)
    conds = {c["type"]: (c["status"], c["reason"]) for c in r1.status["conditions"]}
    assert conds == {"Ready": ("False", "ReplicasNotReady"), "PrefillReady": ("True", "AllReplicasReady"),
                     "DecodeReady": ("False", "ReplicasNotReady"), "RouterReady": ("True", "AllReplicasReady")}
    assert r1.status["phase"] == "Progressing"
    assert r1.status["decode"] == {"desiredReplicas": 3, "replicas": 3, "readyReplicas": 1, "ready": "1/3",
                                   "selector": "app.kubernetes.io/name=pdserve,app.kubernetes.io/instance=m,"
                                               "app.kubernetes.io/component=runtime,pdserve.dev/role=decode"}
    deps["m-decode"] = deployment_status(r0, "m-decode", 3)
    later = NOW + dt.timedelta(minutes=5)
    r2 = reconcile(isvc(PD, status=r1.status), Observed(deployments=deps), later)
    conds = {c["type"]: c for c in r2.status["conditions"]}
    assert conds["Ready"]["status"] == "True" and r2.status["phase"] == "Ready"
    assert conds["Ready"]["lastTransitionTime"] == "2026-01-02T03:09:05Z"  # changed now
    assert conds["PrefillReady"]["lastTransitionTime"] == "2026-01-02T03:04:05Z"  # unchanged since r1
    assert r2.status["endpoint"] == "http://m.ns.svc"


def test_rollout_in_progress_is_not_ready():
    r0 = reconcile(isvc(PD), Observed(), NOW)
    deps = {n: deployment_status(r0, n, 3) for n in ("m-prefill", "m-decode", "m-router")}
    deps["m-decode"]["metadata"]["generation"] = 2  # spec changed, controller has not observed it yet
    conds = {c["type"]: c["reason"] for c in reconcile(isvc(PD), Observed(deployments=deps), NOW).status["conditions"]}
    assert conds["DecodeReady"] == "RollingOut"


def test_prune_pools_no_longer_in_spec():
    r_pd = reconcile(isvc(PD), Observed(), NOW)
    observed = Observed(deployments={o["metadata"]["name"]: o for o in r_pd.objects if o["kind"] == "Deployment"},
                        services={o["metadata"]["name"]: o for o in r_pd.objects if o["kind"] == "Service"})
    r = reconcile(isvc({"model": {"name": "smol"}}), observed, NOW)
    assert r.prune == [("Deployment", "m-prefill")]
    assert reconcile(isvc(PD), observed, NOW).prune == []


def test_every_pod_template_carries_the_config_map_hash(monkeypatch):
    from pdserve.operator import configmap

    def hashes() -> set[str]:
        r = reconcile(isvc(PD), Observed(), NOW)
        return {o["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
                for o in r.objects if o["kind"] == "Deployment"}

    before = hashes()
    assert len(before) == 1  # prefill, decode and router all load the same ConfigMap
    monkeypatch.setattr(configmap, "shared_env", lambda: {"PDSERVE_HASH_SEED": "other"})
    after = hashes()
    assert len(after) == 1 and after != before  # a ConfigMap change rolls every pool
