"""Level-based reconciliation: ``reconcile(body, observed) -> Reconciliation`` (pure; no API calls).

Given an InferenceService and the owned objects that exist now, it returns every object that should exist (each with
a controller owner reference, to be server-side applied), the owned Deployments/Services that must go (e.g. the
prefill pool after spec.prefill was removed), and the status that describes what was observed. The kopf handlers
only fetch ``observed``, call this, and apply the result, so create, update, resume, drift repair and status refresh
all run the same code.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import pydantic

from pdserve.operator import names, pod
from pdserve.operator.configmap import build_config_map, build_kv_token_secret, config_hash
from pdserve.operator.lora_sync import PodAdapters, lora_status
from pdserve.operator.models import InferenceServiceSpec
from pdserve.operator.pdb import build_pdb
from pdserve.operator.pod import InvalidSpec
from pdserve.operator.router_objects import build_router_deployment, build_router_rbac
from pdserve.operator.runtime_deployment import build_runtime_deployment, lora_enabled
from pdserve.operator.services import build_headless_service, build_router_service, endpoint_url

PRUNABLE_KINDS = ("Deployment", "Service", "PodDisruptionBudget")  # kinds whose set of names depends on the spec


@dataclass
class Observed:
    """Owned objects that exist now, by name (what `kube.observe` lists by the instance label)."""

    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    pdbs: dict[str, dict[str, Any]] = field(default_factory=dict)
    adapters: list[PodAdapters] | None = None  # the last LoRA round over the ready runtime pods (lora_sync.py)


@dataclass
class Reconciliation:
    objects: list[dict[str, Any]]  # server-side applied, in order
    create_only: list[dict[str, Any]]  # created when missing, never updated (the random KV token Secret)
    prune: list[tuple[str, str]]  # (kind, name) of owned objects no longer desired
    status: dict[str, Any]
    error: InvalidSpec | None = None


def parse_spec(body: dict[str, Any]) -> InferenceServiceSpec:
    """The validated spec, or InvalidSpec("InvalidSpec", ...) naming the offending fields."""
    try:
        return InferenceServiceSpec.model_validate(body.get("spec") or {})
    except pydantic.ValidationError as e:
        where = "; ".join(f"spec.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
        raise InvalidSpec("InvalidSpec", where) from None


def desired_objects(body: dict[str, Any], spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Every owned object, in apply order (config and RBAC before the pods that use them)."""
    name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    cm = build_config_map(name, ns)
    chash = config_hash(cm["data"])
    roles = ["prefill", "decode"] if spec.prefill is not None else ["both"]
    objects = [cm, *build_router_rbac(name, ns), build_headless_service(name, ns, spec),
               *(build_runtime_deployment(name, ns, spec, role, chash) for role in roles),
               build_router_deployment(name, ns, spec, chash), build_router_service(name, ns, spec),
               *(build_pdb(name, ns, role) for role in [*roles, "router"])]
    owner = pod.owner_reference(body)
    for obj in objects:
        obj["metadata"]["ownerReferences"] = [owner]
    return objects


def reconcile(body: dict[str, Any], observed: Observed, now: dt.datetime | None = None) -> Reconciliation:
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        spec = parse_spec(body)
        objects = desired_objects(body, spec)
    except InvalidSpec as e:  # keep what runs; report, do not touch children
        return Reconciliation([], [], [], invalid_status(body, e, now), e)
    wanted = {(o["kind"], o["metadata"]["name"]) for o in objects}
    existing = ([("Deployment", n) for n in observed.deployments] + [("Service", n) for n in observed.services]
                + [("PodDisruptionBudget", n) for n in observed.pdbs])
    prune = sorted(k for k in existing if k not in wanted)
    secret = build_kv_token_secret(body["metadata"]["name"], body["metadata"]["namespace"])
    secret["metadata"]["ownerReferences"] = [pod.owner_reference(body)]
    return Reconciliation(objects, [secret], prune, compute_status(body, spec, observed, now))


def _pool_status(deployment: dict[str, Any] | None, desired: int, selector: str) -> tuple[dict[str, Any], bool, str]:
    """(PoolStatus dict, ready?, reason) from one Deployment."""
    st = (deployment or {}).get("status") or {}
    ready, replicas = st.get("readyReplicas", 0), st.get("replicas", 0)
    out = {"desiredReplicas": desired, "replicas": replicas, "readyReplicas": ready, "ready": f"{ready}/{desired}",
           "selector": selector}
    if deployment is None:
        return out, False, "DeploymentMissing"
    rolled_out = (st.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
                  and st.get("updatedReplicas", 0) >= desired and replicas == desired)
    if ready >= desired and rolled_out:
        return out, True, "AllReplicasReady"
    return out, False, "RollingOut" if not rolled_out else "ReplicasNotReady"


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def compute_status(body: dict[str, Any], spec: InferenceServiceSpec, observed: Observed,
                   now: dt.datetime) -> dict[str, Any]:
    name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    status: dict[str, Any] = {"observedGeneration": body["metadata"].get("generation")}
    conds: list[tuple[str, bool, str, str]] = []
    pools = [("prefill", "prefill", spec.prefill), ("decode", "decode" if spec.prefill else "both", spec.decode),
             ("router", "router", spec.router)]
    for key, role, pool_spec in pools:
        cond_type = f"{key.capitalize()}Ready"
        if pool_spec is None:
            status[key] = None  # merge patch: removes a stale pool status (e.g. after switching to monolithic)
            conds.append((cond_type, True, "NotDisaggregated", "no prefill pool: decode pods serve whole requests"))
            continue
        dep = observed.deployments.get(names.pool_name(name, role))
        ps, ok, reason = _pool_status(dep, pool_spec.replicas, _selector(names.pod_labels(name, role)))
        status[key] = ps
        conds.append((cond_type, ok, reason, f"{ps['ready']} {role} replicas ready"))
    serving = spec.decode.replicas > 0 and spec.router.replicas > 0
    all_ok = all(ok for _, ok, _, _ in conds)
    if all_ok and serving:
        ready = ("Ready", True, "AllPoolsReady", "every pool has all replicas ready")
    elif all_ok:
        ready = ("Ready", False, "ScaledToZero", "decode or router replicas are 0")
    else:
        ready = ("Ready", False, next(r for _, ok, r, _ in conds if not ok), "; ".join(
            f"{t}: {m}" for t, ok, _, m in conds if not ok))
    status["loras"] = None  # merge patch: removes the list when LoRA is off
    if lora_enabled(spec):  # Ready is about the base model; adapters have their own condition
        status["loras"], lora_cond = lora_status(spec, observed.adapters)
        conds.append(lora_cond)
    status["conditions"] = _conditions(body, [ready, *conds], now)
    status["phase"] = "Ready" if ready[1] else ("Pending" if not observed.deployments else "Progressing")
    status["endpoint"] = endpoint_url(name, ns, spec)
    return status


def invalid_status(body: dict[str, Any], error: InvalidSpec, now: dt.datetime) -> dict[str, Any]:
    conds = [("Ready", False, error.reason, str(error))]
    return {"observedGeneration": body["metadata"].get("generation"), "phase": "Failed",
            "conditions": _conditions(body, conds, now, keep_others=True)}


def _conditions(body: dict[str, Any], conds: list[tuple[str, bool, str, str]], now: dt.datetime,
                keep_others: bool = False) -> list[dict[str, Any]]:
    """Condition dicts; lastTransitionTime is kept from the previous status while the status value is unchanged."""
    previous = {c.get("type"): c for c in (body.get("status") or {}).get("conditions") or []}
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for ctype, ok, reason, message in conds:
        value = "True" if ok else "False"
        old = previous.pop(ctype, None)
        since = old["lastTransitionTime"] if old and old.get("status") == value and old.get("lastTransitionTime") \
            else stamp
        out.append({"type": ctype, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": since, "observedGeneration": body["metadata"].get("generation")})
    return out + (list(previous.values()) if keep_others else [])
