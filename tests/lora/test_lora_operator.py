"""InferenceService ``spec.loras`` rendered into every runtime pod of both roles (pure builders, no cluster): the
``pdserve serve`` flags, parsed by the real CLI into the engine's LoRA config, and one read-only volume per claim."""

from __future__ import annotations

import argparse
import datetime as dt

from pdserve.operator.reconcile import Observed, reconcile
from pdserve.runtime import cli
from pdserve.runtime.config import EngineConfig, LoRAModule
from tests.operator.test_operator_builders import by_name, container, isvc

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
LORAS = [{"name": "sql", "uri": "pvc://adapters/sql"}, {"name": "chat", "uri": "pvc://adapters/chat/v2"},
         {"name": "baked", "uri": "/opt/adapters/baked"}]


def test_loras_reach_every_runtime_pod_and_parse():
    spec = {"model": {"name": "smol"}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "loras": LORAS}
    r = reconcile(isvc(spec), Observed(), NOW)
    assert r.error is None
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    for role in ("prefill", "decode"):
        dep = by_name(r, "Deployment", f"m-{role}")
        args = container(dep)["args"]
        config = EngineConfig.from_options(**cli.engine_options(parser.parse_args(args)))
        assert config.lora.enable_lora and config.lora.max_loras == 3
        assert config.lora.lora_modules == (LoRAModule("sql", "/models/lora/adapters/sql"),
                                            LoRAModule("chat", "/models/lora/adapters/chat/v2"),
                                            LoRAModule("baked", "/opt/adapters/baked"))
        volumes = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"].startswith("lora-")]
        assert volumes == [{"name": "lora-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}]
        mounts = [m for m in container(dep)["volumeMounts"] if m["name"].startswith("lora-")]
        assert mounts == [{"name": "lora-0", "mountPath": "/models/lora/adapters", "readOnly": True}]


def test_no_loras_no_flags_and_bad_names_refused():
    r = reconcile(isvc({"model": {"name": "smol"}}), Observed(), NOW)
    assert "--enable-lora" not in container(by_name(r, "Deployment", "m-decode"))["args"]
    for loras in ([LORAS[0], LORAS[0]], [{"name": "smol", "uri": "/a"}], [{"name": "x", "uri": "hf://org/x"}]):
        assert reconcile(isvc({"model": {"name": "smol"}, "loras": loras}), Observed(), NOW).error is not None
