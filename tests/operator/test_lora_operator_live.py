"""Live LoRA adapters on a real kube-apiserver with REAL runtime pods: the operator loads/unloads spec.loras in running
pods through their API and reports per-adapter readiness.

kwok runs no containers (there is no kubelet here), so for each runtime pod (one prefill, one decode) the test does what
a kubelet would: it starts ``pdserve serve`` with the container's args from the Pod object, ``$(VAR)`` expanded from the
pod's env (status.podIP, the API key Secret), bound to the pod's IP (loopback, kubeenv.POD_CIDR) instead of 0.0.0.0 (a
pod has its own network namespace). Real PEFT adapters are made with ``peft`` on the default model."""

from __future__ import annotations

import base64
import contextlib
import re
import shutil
import sys

import httpx
import pytest

from pdserve.operator import names
from tests.operator.test_operator_cluster import condition, isvc_path
from tests.support.lora import make_adapter
from tests.support.redis import redis_server
from tests.support.server import launch_process

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAME, API_KEY = "loras", "test-runtime-key"
ROLES = ("prefill", "decode")


def _spec(loras: list[dict], redis_url: str) -> dict:
    return {"kvTransfer": {"connector": "redis", "redis": {"url": redis_url}},  # NIXL's UCX needs a real interface IP
            "model": {"name": "smol", "uri": "default"},
            "runtime": {"dtype": "float32", "kvCacheMemory": "32Mi", "maxModelLen": 512, "blockSize": 16,
                        "apiKeySecretRef": {"name": "runtime-key", "key": "key"}},
            "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "router": {"replicas": 1},
            "loraConfig": {"maxLoras": 2, "maxLoraRank": 16}, "loras": loras}


def _pods(cluster, ns: str) -> dict[str, dict]:
    items = cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector={names.INSTANCE_LABEL}={NAME},"
                        f"{names.COMPONENT_LABEL}=runtime")["items"]
    return {p["metadata"]["labels"][names.ROLE_LABEL]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def _kubelet_cmd(cluster, ns: str, pod: dict) -> tuple[list[str], dict[str, str]]:
    """The container's command line and env as a kubelet would run them (envFrom's shared ConfigMap is left out: its
    cache directory is the image's)."""
    c = pod["spec"]["containers"][0]
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[e["name"]] = pod["status"]["podIP"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            data = cluster.get(f"/api/v1/namespaces/{ns}/secrets/{ref['name']}")["data"]
            env[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    args[args.index("--host") + 1] = pod["status"]["podIP"]  # the pod's own network namespace, emulated
    return [sys.executable, "-m", "pdserve", *args], {**env, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def live(cluster, operator, tmp_path_factory):
    """The InferenceService (prefill + decode, adapter `attn` loaded at start) and a real server per runtime pod."""
    root = tmp_path_factory.mktemp("adapters")
    adapters = {"attn": make_adapter(root / "attn", 8, 16, ["q_proj", "v_proj"], False, seed=1),
                "mlp": make_adapter(root / "mlp", 16, 8, ["gate_proj", "up_proj", "down_proj"], True, seed=2)}
    corrupt = adapters["corrupt"] = root / "corrupt"
    shutil.copytree(adapters["attn"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    stack = contextlib.ExitStack()
    redis = stack.enter_context(redis_server())
    ns = cluster.create_namespace("lora-live")
    r = cluster.http.post(f"/api/v1/namespaces/{ns}/secrets", json={
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "runtime-key"}, "stringData": {"key": API_KEY}})
    assert r.status_code == 201, r.text
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": NAME, "namespace": ns},
            "spec": _spec([{"name": "attn", "uri": str(adapters["attn"])}], redis.url)}
    r = cluster.http.post(isvc_path(ns), json=body)
    assert r.status_code == 201, r.text
    pods = cluster.wait_for(lambda: (p := _pods(cluster, ns)) and len(p) == 2
                            and all(x["status"].get("podIP") for x in p.values()) and p, 90, "runtime pods with IPs")
    with stack:
        urls = {}
        for role in ROLES:
            cmd, env = _kubelet_cmd(cluster, ns, pods[role])
            ip = pods[role]["status"]["podIP"]
            stack.enter_context(launch_process(cmd, names.RUNTIME_PORT, host=ip, env=env))
            urls[role] = f"http://{ip}:{names.RUNTIME_PORT}"
        yield {"ns": ns, "pods": pods, "urls": urls, "adapters": adapters}
        cluster.http.delete(isvc_path(ns, NAME))  # the operator stops calling these pods before they go


def _models(url: str) -> dict[str, str | None]:
    """Adapter name -> directory, as the pod lists them (GET /v1/models with the runtime key)."""
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    r.raise_for_status()
    return {m["id"]: m["root"] for m in r.json()["data"] if m.get("parent")}


def _set_loras(cluster, ns: str, loras: list[dict]) -> None:
    r = cluster.http.patch(isvc_path(ns, NAME), json={"spec": {"loras": loras}},
                           headers={"Content-Type": "application/merge-patch+json"})
    assert r.status_code == 200, r.text


def _status_loras(cluster, ns: str) -> dict[str, dict]:
    body = cluster.get(isvc_path(ns, NAME))
    if body["status"].get("observedGeneration") != body["metadata"]["generation"]:
        return {}
    return {s["name"]: s for s in body["status"].get("loras") or []}


def _complete(url: str, model: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                   json={"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _identity(cluster, ns: str) -> tuple:
    """What a rollout would change: the pods' UIDs and template hashes, and each Deployment's generation."""
    pods = _pods(cluster, ns)
    deps = [cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{NAME}-{r}")["metadata"]["generation"]
            for r in ROLES]
    return (sorted((p["metadata"]["uid"], p["metadata"]["labels"]["pod-template-hash"]) for p in pods.values()),
            deps)


def test_spec_loras_reach_both_roles_with_the_api_key(cluster, live):
    ns, urls, path = live["ns"], live["urls"], str(live["adapters"]["attn"])
    cluster.wait_for(lambda: all(_models(u).get("attn") == path for u in urls.values()), 120,
                     "adapter attn loaded on the prefill and the decode pod")
    assert httpx.get(f"{urls['decode']}/v1/models", timeout=10).status_code == 401  # the operator authenticated
    st = cluster.wait_for(lambda: (s := _status_loras(cluster, ns)).get("attn", {}).get("ready") == "2/2" and s,
                          60, "status.loras attn 2/2")
    assert st["attn"] == {"name": "attn", "readyReplicas": 2, "desiredReplicas": 2, "ready": "2/2", "message": ""}
    assert condition(cluster.get(isvc_path(ns, NAME)), "LoRAAdaptersReady")["status"] == "True"
    assert _complete(urls["decode"], "attn") != _complete(urls["decode"], "smol")  # the adapter really serves


def test_adding_and_removing_adapters_keeps_the_pods(cluster, live):
    ns, urls, adapters = live["ns"], live["urls"], live["adapters"]
    cluster.wait_for(lambda: all("attn" in _models(u) for u in urls.values()), 120, "attn loaded")
    before = _identity(cluster, ns)
    _set_loras(cluster, ns, [{"name": "attn", "uri": str(adapters["attn"])},
                             {"name": "mlp", "uri": str(adapters["mlp"])}])
    cluster.wait_for(lambda: all(_models(u).get("mlp") == str(adapters["mlp"]) for u in urls.values()), 120,
                     "mlp loaded on both pods")
    cluster.wait_for(lambda: _status_loras(cluster, ns).get("mlp", {}).get("ready") == "2/2", 60, "mlp 2/2")
    _set_loras(cluster, ns, [{"name": "mlp", "uri": str(adapters["mlp"])}])
    cluster.wait_for(lambda: all(set(_models(u)) == {"mlp"} for u in urls.values()), 120, "attn unloaded")
    cluster.wait_for(lambda: set(_status_loras(cluster, ns)) == {"mlp"}, 60, "status lists only mlp")
    assert _identity(cluster, ns) == before  # same pods, same template: nothing rolled
    for u in urls.values():  # and they are the processes the test started: still serving
        assert httpx.get(f"{u}/health", timeout=10).status_code == 200


def test_corrupt_adapter_is_reported_and_the_pod_keeps_serving(cluster, live):
    ns, urls, adapters = live["ns"], live["urls"], live["adapters"]
    _set_loras(cluster, ns, [{"name": "mlp", "uri": str(adapters["mlp"])},
                             {"name": "bad", "uri": str(adapters["corrupt"])}])
    st = cluster.wait_for(lambda: (s := _status_loras(cluster, ns)).get("bad", {}).get("message") and s, 120,
                          "status.loras reports the corrupt adapter")
    # the pod's own 400 answer for the same directory is what the status carries
    r = httpx.post(f"{urls['decode']}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"lora_name": "bad", "lora_path": str(adapters["corrupt"])}, timeout=30)
    assert r.status_code == 400
    assert st["bad"]["message"] == r.json()["error"]["message"] and st["bad"]["readyReplicas"] == 0
    assert st["mlp"]["ready"] == "2/2"
    cond = condition(cluster.get(isvc_path(ns, NAME)), "LoRAAdaptersReady")
    assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed") and "bad: " in cond["message"]
    assert condition(cluster.get(isvc_path(ns, NAME)), "Ready")["status"] == "True"  # the base model still serves
    events = cluster.wait_for(lambda: [e for e in cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
                                       if e["reason"] == "LoRALoadFailed"], 30, "LoRALoadFailed Event")
    assert {e["type"] for e in events} == {"Warning"} and all("adapter bad on pod" in e["message"] for e in events)
    assert len(events) == 2  # one per pod, not one per resync
    for u in urls.values():
        assert set(_models(u)) == {"mlp"}
    assert _complete(urls["decode"], "mlp")


def _blocks_loaded(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve:kv_connector_blocks_loaded_total")


def test_pd_handoff_with_an_operator_loaded_adapter(cluster, live):
    """Prefill pod -> decode pod over HTTP (as the router does, router/pd.py) with an adapter the operator loaded:
    equals the monolithic answer; a decode pod without the adapter answers 404, not a wrong answer."""
    from pdserve.router.pd import REMOTE_DECODE_PARAMS, decode_body, prefill_body

    urls, auth = live["urls"], {"Authorization": f"Bearer {API_KEY}"}
    cluster.wait_for(lambda: all("mlp" in _models(u) for u in urls.values()), 120, "mlp loaded")
    body = {"model": "mlp", "max_tokens": 8, "temperature": 0,
            "prompt": "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
                      "combined movable metal type, oil-based ink and a screw press.\nQ: Who was Gutenberg?\nA:"}
    mono = httpx.post(f"{urls['prefill']}/v1/completions", headers=auth, json=body, timeout=120)
    assert mono.status_code == 200, mono.text

    def prefill() -> dict:
        r = httpx.post(f"{urls['prefill']}/v1/completions", headers=auth, timeout=120,
                       json={**prefill_body(body), "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)})
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["lora_name"] == "mlp"
        return params

    params, loaded = prefill(), _blocks_loaded(urls["decode"])
    r = httpx.post(f"{urls['decode']}/v1/completions", headers=auth, json=decode_body(body, params), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == mono.json()["choices"][0]["text"]
    assert _blocks_loaded(urls["decode"]) - loaded >= 2  # the adapter's KV really came over from the prefill pod
    assert "attn" not in _models(urls["decode"])
    r = httpx.post(f"{urls['decode']}/v1/completions", headers=auth, timeout=120,
                   json=decode_body({**body, "model": "attn"}, prefill()))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
