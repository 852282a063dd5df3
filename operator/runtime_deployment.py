"""Deployment of one runtime pool (`pdserve serve` pods with role prefill, decode or both).

A pool's settings are spec.runtime overlaid with the pool's own overrides (spec.prefill / spec.decode): a field the
pool sets wins, whole (lists and maps are replaced, not merged), except ``env`` which is appended so a pool can add
variables without repeating the shared ones.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.operator import names, pod
from pdserve.operator.configmap import (KV_TOKEN_ENV, KV_TOKEN_KEY, POD_IP_ENV, REDIS_URL_ENV, env_from,
                                       kv_connector_config)
from pdserve.operator.models import InferenceServiceSpec, LoRAConfigSpec, PoolSpec, RuntimeOverrides, RuntimeSpec

API_KEY_ENV = "PDSERVE_API_KEY"  # runtime/envs.api_key()
LORA_UPDATING_ENV = "PDSERVE_ALLOW_RUNTIME_LORA_UPDATING"  # runtime/envs.allow_runtime_lora_updating()
STARTUP_SECONDS = 900  # model download + load before liveness applies


def effective_runtime(spec: InferenceServiceSpec, pool: PoolSpec) -> RuntimeSpec:
    """spec.runtime with the pool's overrides applied (see the module docstring)."""
    overrides = {k: v for k, v in pool.model_dump(exclude_unset=True, exclude={"replicas"}).items()
                 if k in RuntimeOverrides.model_fields and v is not None}
    merged = spec.runtime.model_copy(update={k: getattr(pool, k) for k in overrides})
    if pool.env and spec.runtime.env:
        merged = merged.model_copy(update={"env": [*spec.runtime.env, *pool.env]})
    return merged


def uses_connector(spec: InferenceServiceSpec, role: str) -> bool:
    """Disaggregated pods always transfer KV; monolithic pods only share a Redis/disk store (NIXL has no peer)."""
    return role != "both" or spec.kv_transfer.connector in ("redis", "disk")


def model_source(spec: InferenceServiceSpec) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(``--model`` args, volumes, mounts) for spec.model.uri."""
    uri = spec.model.uri
    if uri == "default":
        return [], [], []  # the runtime's built-in default model
    if uri.startswith("hf://"):
        return ["--model", uri.removeprefix("hf://")], [], []
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        mount = f"{names.MODELS_MOUNT}/{claim}"
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return ["--model", f"{mount}/{sub}".rstrip("/")], [volume], [{"name": "model", "mountPath": mount,
                                                                      "readOnly": True}]
    return ["--model", uri], [], []


def lora_enabled(spec: InferenceServiceSpec) -> bool:
    """Pods serve adapters when spec.loras (even ``[]``) or spec.loraConfig is set."""
    return spec.loras is not None or spec.lora_config is not None


def _claim_of(uri: str) -> tuple[str, str] | None:
    if not uri.startswith("pvc://"):
        return None
    claim, _, sub = uri.removeprefix("pvc://").partition("/")
    return claim, sub


def lora_paths(spec: InferenceServiceSpec) -> dict[str, str]:
    """Adapter name -> its directory inside the pod (what the operator passes to /v1/load_lora_adapter)."""
    out = {}
    for lora in spec.loras or []:
        pvc = _claim_of(lora.uri)
        out[lora.name] = lora.uri if pvc is None else f"{names.MODELS_MOUNT}/lora/{pvc[0]}/{pvc[1]}".rstrip("/")
    return out


def lora_source(spec: InferenceServiceSpec) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(LoRA args, volumes, mounts). The adapters themselves are NOT in the pod template: the operator loads them
    through the pods' API (operator/lora_sync.py), so that changing spec.loras keeps the pods. ``--max-loras`` is
    spec.loraConfig.maxLoras (default 4), never the number of adapters, for the same reason. One read-only volume per
    distinct claim, named after a digest of the claim so that adding an adapter on a known claim changes nothing."""
    if not lora_enabled(spec):
        return [], [], []
    cfg = spec.lora_config or LoRAConfigSpec()
    args = ["--enable-lora", "--max-loras", str(cfg.max_loras), "--max-lora-rank", str(cfg.max_lora_rank)]
    if cfg.max_cpu_loras:
        args += ["--max-cpu-loras", str(cfg.max_cpu_loras)]
    volumes, mounts = [], []
    for claim in sorted({pvc[0] for lora in spec.loras or [] if (pvc := _claim_of(lora.uri))}):
        vol = f"lora-{hashlib.sha256(claim.encode()).hexdigest()[:12]}"
        volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": vol, "mountPath": f"{names.MODELS_MOUNT}/lora/{claim}", "readOnly": True})
    return args, volumes, mounts


def serve_args(spec: InferenceServiceSpec, rt: RuntimeSpec, role: str, model_args: list[str]) -> list[str]:
    args = ["serve", *model_args, "--host", "0.0.0.0", "--port", str(names.RUNTIME_PORT), "--role", role,
            "--served-model-name", spec.model.name]
    # an API key comes from env PDSERVE_API_KEY (the runtime's own fallback), never from args (visible in ps)
    args += ["--block-size", str(rt.block_size),
             "--kv-cache-memory", str(pod.parse_bytes(rt.kv_cache_memory, "kvCacheMemory"))]
    if rt.max_model_len:
        args += ["--max-model-len", str(rt.max_model_len)]
    args += ["--dtype", rt.dtype]
    if uses_connector(spec, role):
        config = json.dumps(kv_connector_config(spec), sort_keys=True, separators=(",", ":"))
        args += ["--kv-connector", spec.kv_transfer.connector, "--kv-connector-config", config]
    args += ["--kv-events-port", str(names.KV_EVENTS_PORT), "--kv-events-replay-port", str(names.KV_EVENTS_REPLAY_PORT),
             "--kv-events-host", f"$({POD_IP_ENV})"]  # routers in other pods subscribe
    return args + lora_source(spec)[0] + list(rt.extra_args or [])


def serve_env(name: str, spec: InferenceServiceSpec, rt: RuntimeSpec) -> list[dict[str, Any]]:
    """Env of a runtime container; the vars referenced as ``$(VAR)`` in args come first (the kubelet requires it)."""
    env = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": KV_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": names.kv_token_secret_name(name),
                                                                 "key": KV_TOKEN_KEY}}}]
    if rt.api_key_secret_ref:
        env.append(pod.secret_env(API_KEY_ENV, rt.api_key_secret_ref))
    redis = spec.kv_transfer.redis
    if spec.kv_transfer.connector == "redis" and redis and redis.url_secret_ref:
        env.append(pod.secret_env(REDIS_URL_ENV, redis.url_secret_ref))
    if spec.model.auth_secret_ref:
        env.append(pod.secret_env("HF_TOKEN", spec.model.auth_secret_ref))
    if lora_enabled(spec):  # the operator manages the adapters through /v1/load_lora_adapter + /v1/unload_lora_adapter
        env.append({"name": LORA_UPDATING_ENV, "value": "true"})
    return env + list(rt.env or [])


def build_runtime_deployment(name: str, namespace: str, spec: InferenceServiceSpec, role: str,
                             config_hash: str) -> dict[str, Any]:
    """Deployment ``names.pool_name(name, role)`` for role prefill, decode or both."""
    pool = spec.prefill if role == "prefill" else spec.decode
    assert pool is not None and role in names.RUNTIME_ROLES
    rt = effective_runtime(spec, pool)
    model_args, model_volumes, model_mounts = model_source(spec)
    volumes, mounts = pod.writable_volumes()
    _, lora_volumes, lora_mounts = lora_source(spec)
    volumes, mounts = volumes + model_volumes + lora_volumes, mounts + model_mounts + lora_mounts
    if spec.kv_transfer.connector == "disk" and uses_connector(spec, role):
        assert spec.kv_transfer.disk is not None
        volumes.append({"name": "kv", "persistentVolumeClaim": {"claimName": spec.kv_transfer.disk.claim_name}})
        mounts.append({"name": "kv", "mountPath": names.KV_MOUNT})
    ports = [{"name": "http", "containerPort": names.RUNTIME_PORT},
             {"name": "kv-events", "containerPort": names.KV_EVENTS_PORT},
             {"name": "kv-replay", "containerPort": names.KV_EVENTS_REPLAY_PORT}]
    if spec.kv_transfer.connector == "nixl" and uses_connector(spec, role):
        ports.append({"name": "nixl", "containerPort": names.NIXL_PORT})
    pod_sc, container_sc = pod.security_context()
    container = {
        "name": "pdserve", "image": rt.image, "args": serve_args(spec, rt, role, model_args),
        "env": serve_env(name, spec, rt), "envFrom": env_from(name), "ports": ports, "volumeMounts": mounts,
        "resources": pod.resources(rt.resources), "securityContext": container_sc,
        "lifecycle": pod.graceful_termination(), **pod.http_probes("http", STARTUP_SECONDS),
    }
    if rt.image_pull_policy:
        container["imagePullPolicy"] = rt.image_pull_policy
    pod_spec = {"containers": [container], "volumes": volumes, "securityContext": pod_sc,
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": pod.TERMINATION_GRACE_SECONDS}
    if rt.node_selector:
        pod_spec["nodeSelector"] = dict(rt.node_selector)
    if rt.tolerations:
        pod_spec["tolerations"] = list(rt.tolerations)
    labels = names.pod_labels(name, role)
    meta = pod.object_meta(names.pool_name(name, role), namespace, name, labels)
    return pod.deployment(meta, pool.replicas, labels, pod_spec, {names.CONFIG_HASH_ANNOTATION: config_hash})
