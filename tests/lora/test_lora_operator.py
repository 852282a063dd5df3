"""InferenceService ``spec.loras`` without a cluster (pure builders and the adapter-round logic): pods start with LoRA on
and runtime updates allowed (flags parsed by the real CLI), the adapter set is NOT in the pod template (so changing it
keeps the pods), what to load/unload on a pod, and the per-adapter status. The live part (real API server, real
``pdserve serve`` pods) is tests/operator/test_lora_operator_live.py."""

from __future__ import annotations

import argparse
import datetime as dt

from pdserve.operator.lora_sync import PodAdapters, plan
from pdserve.operator.reconcile import Observed, parse_spec, reconcile
from pdserve.operator.runtime_deployment import LORA_UPDATING_ENV, lora_paths
from pdserve.runtime import cli
from pdserve.runtime.config import EngineConfig
from tests.operator.test_operator_builders import by_name, container, isvc

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
LORAS = [{"name": "sql", "uri": "pvc://adapters/sql"}, {"name": "chat", "uri": "pvc://adapters/chat/v2"},
         {"name": "baked", "uri": "/opt/adapters/baked"}]
PD = {"model": {"name": "smol"}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def _engine_config(args: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return EngineConfig.from_options(**cli.engine_options(parser.parse_args(args)))


def _templates(spec: dict) -> dict[str, dict]:
    r = reconcile(isvc(spec), Observed(), NOW)
    assert r.error is None, r.error
    return {role: by_name(r, "Deployment", f"m-{role}")["spec"]["template"] for role in ("prefill", "decode")}


def test_pods_start_with_lora_on_and_runtime_updates_allowed_in_both_roles():
    r = reconcile(isvc({**PD, "loras": LORAS, "loraConfig": {"maxLoras": 2, "maxCpuLoras": 6}}), Observed(), NOW)
    assert r.error is None
    for role in ("prefill", "decode"):
        dep = by_name(r, "Deployment", f"m-{role}")
        c = container(dep)
        config = _engine_config(c["args"])
        assert config.lora.enable_lora and config.lora.max_loras == 2 and config.lora.max_cpu_loras == 6
        assert config.lora.max_lora_rank == 64 and config.lora.lora_modules == ()  # the operator loads them live
        assert {"name": LORA_UPDATING_ENV, "value": "true"} in c["env"]
        volumes = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"].startswith("lora-")]
        assert [v["persistentVolumeClaim"] for v in volumes] == [{"claimName": "adapters", "readOnly": True}]
        mounts = [m for m in c["volumeMounts"] if m["name"].startswith("lora-")]
        assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [("/models/lora/adapters", True)]
    assert lora_paths(parse_spec(isvc({**PD, "loras": LORAS}))) == {
        "sql": "/models/lora/adapters/sql", "chat": "/models/lora/adapters/chat/v2", "baked": "/opt/adapters/baked"}


def test_changing_the_adapter_set_keeps_the_pod_template():
    """Adding/removing adapters (in the image or on a claim already mounted) leaves both templates byte-identical,
    so the Deployments keep their pods; only a new claim (a new volume) changes the template. An empty list keeps
    LoRA on, so the first adapter can be added live too; --max-loras never follows the number of adapters."""
    base = _templates({**PD, "loras": LORAS[:1]})
    assert _templates({**PD, "loras": LORAS}) == base
    assert _templates({**PD, "loras": LORAS[1:2]}) == base
    assert _templates({**PD, "loras": [*LORAS, *({"name": f"x{i}", "uri": f"/a/{i}"} for i in range(8))]}) == base
    assert _templates({**PD, "loras": []}) == _templates({**PD, "loras": [LORAS[2]]})
    assert _templates({**PD, "loras": [*LORAS, {"name": "n", "uri": "pvc://other/n"}]}) != base
    off = _templates(PD)["decode"]["spec"]["containers"][0]
    assert "--enable-lora" not in off["args"] and LORA_UPDATING_ENV not in {e["name"] for e in off["env"]}


def test_plan_loads_missing_unloads_unwanted_and_moved():
    desired = {"a": "/x/a", "b": "/x/b", "c": "/x/c"}
    loaded = {"a": "/x/a", "b": "/old/b", "z": "/x/z"}
    load, unload = plan(desired, loaded)
    assert load == [("b", "/x/b"), ("c", "/x/c")] and unload == ["b", "z"]
    assert plan(desired, dict(desired)) == ([], [])


def test_status_reports_each_adapter_and_a_condition():
    spec = {**PD, "loras": LORAS[:2]}

    def status(pods):
        r = reconcile(isvc(spec), Observed(adapters=pods), NOW)
        cond = next(c for c in r.status["conditions"] if c["type"] == "LoRAAdaptersReady")
        return r.status["loras"], cond

    loras, cond = status(None)
    assert loras == [{"name": "sql", "readyReplicas": 0, "desiredReplicas": 3, "ready": "0/3",
                      "message": "loaded on 0 of 3 runtime pods"},
                     {"name": "chat", "readyReplicas": 0, "desiredReplicas": 3, "ready": "0/3",
                      "message": "loaded on 0 of 3 runtime pods"}]
    assert (cond["status"], cond["reason"]) == ("False", "AdaptersLoading")
    every = [PodAdapters(f"p{i}", f"u{i}", frozenset({"sql", "chat"})) for i in range(3)]
    loras, cond = status(every)
    assert [(s["ready"], s["message"]) for s in loras] == [("3/3", ""), ("3/3", "")]
    assert (cond["status"], cond["reason"]) == ("True", "AdaptersLoaded")
    broken = [*every[:2], PodAdapters("p2", "u2", frozenset({"sql"}), {"chat": "adapter_model.safetensors: bad"})]
    loras, cond = status(broken)
    assert loras[1] == {"name": "chat", "readyReplicas": 2, "desiredReplicas": 3, "ready": "2/3",
                        "message": "adapter_model.safetensors: bad"}
    assert (cond["status"], cond["reason"]) == ("False", "AdapterLoadFailed")
    assert "chat: adapter_model.safetensors: bad" in cond["message"]
    r = reconcile(isvc(spec), Observed(adapters=broken), NOW)
    assert next(c for c in r.status["conditions"] if c["type"] == "Ready")["reason"] != "AdapterLoadFailed"
    off = reconcile(isvc(PD), Observed(), NOW).status
    assert off["loras"] is None and all(c["type"] != "LoRAAdaptersReady" for c in off["conditions"])


def test_bad_names_refused():
    for loras in ([LORAS[0], LORAS[0]], [{"name": "smol", "uri": "/a"}], [{"name": "x", "uri": "hf://org/x"}]):
        assert reconcile(isvc({"model": {"name": "smol"}, "loras": loras}), Observed(), NOW).error is not None
