"""Live LoRA adapters: every ready runtime pod (both roles) is brought to spec.loras through its own API.

Runtime pods start with LoRA on and runtime updates allowed (runtime_deployment.lora_source: ``--enable-lora``, fixed
``--max-loras``, ``PDSERVE_ALLOW_RUNTIME_LORA_UPDATING=true``) but no adapters in their template, so a change of
spec.loras never rolls them. On every sync of an InferenceService (create/update/resume, the resync timer, and each
status change of its Deployments, e.g. a pod turning Ready) the operator, for each ready runtime pod:

1. ``GET /v1/models`` (adapter cards have a ``parent``; ``root`` is the directory they were loaded from);
2. ``POST /v1/unload_lora_adapter`` for every adapter not wanted, or wanted from another directory;
3. ``POST /v1/load_lora_adapter`` for every wanted adapter the pod lacks. A refusal (400: a corrupt or incompatible
   adapter) is kept with the pod's message: status.loras[].message, condition ``LoRAAdaptersReady=False``
   (``AdapterLoadFailed``) and one Warning Event ``LoRALoadFailed`` per pod, adapter and message. The pod keeps
   serving everything else; the load is retried on the next sync (level-based).

Requests go to ``status.podIP`` of the API server's Pod object (pod.runtime_url) and only to pods our Deployments'
ReplicaSets control, carry the runtime API key (spec.runtime.apiKeySecretRef, read from its Secret each round) and
have short timeouts; a pod that does not answer just counts as not having the adapters yet.

Until the operator's first round after a pod turned Ready, that pod answers 404 for adapters; the router's
``lora-registered`` filter keeps an adapter's requests on pods that have it meanwhile (router/plugins/lora_filter.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from pdserve.operator import names
from pdserve.operator import pod as pod_helpers
from pdserve.operator.models import InferenceServiceSpec

log = logging.getLogger(__name__)

LIST_TIMEOUT = 5.0       # GET /v1/models, POST unload
LOAD_TIMEOUT = 30.0      # POST load reads and validates the adapter's files
MAX_BODY = 1 << 20
MAX_MESSAGE = 512
CONDITION = "LoRAAdaptersReady"


@dataclass(frozen=True)
class PodAdapters:
    """One ready runtime pod after a round: the wanted adapters it has (from the wanted directory), and why not."""

    pod: str
    uid: str
    loaded: frozenset[str] = frozenset()
    errors: dict[str, str] = field(default_factory=dict)  # adapter -> the pod's refusal (its 400 message)
    unreachable: str | None = None                         # the pod's API could not be read this round


def plan(desired: dict[str, str], loaded: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(to load: (name, path), to unload: name) that turn ``loaded`` (name -> path on the pod) into ``desired``. An
    adapter wanted from another directory is unloaded and loaded again."""
    unload = sorted(n for n, path in loaded.items() if desired.get(n) != path)
    load = [(n, path) for n, path in desired.items() if loaded.get(n) != path]
    return load, unload


def lora_status(spec: InferenceServiceSpec, pods: list[PodAdapters] | None,
                ) -> tuple[list[dict[str, Any]], tuple[str, bool, str, str]]:
    """(status.loras, the LoRAAdaptersReady condition) from the last round (``None``: no round yet)."""
    pods = pods or []
    desired = (spec.prefill.replicas if spec.prefill else 0) + spec.decode.replicas
    out, failures = [], []
    for lora in spec.loras or []:
        ready = sum(lora.name in p.loaded for p in pods)
        errors = sorted({p.errors[lora.name] for p in pods if lora.name in p.errors})
        failures += [f"{lora.name}: {e}" for e in errors]
        message = "; ".join(errors) or ("" if ready >= desired else f"loaded on {ready} of {desired} runtime pods")
        out.append({"name": lora.name, "readyReplicas": ready, "desiredReplicas": desired,
                    "ready": f"{ready}/{desired}", "message": message[:MAX_MESSAGE]})
    if failures:
        return out, (CONDITION, False, "AdapterLoadFailed", "; ".join(failures)[:MAX_MESSAGE])
    missing = [s["name"] for s in out if s["readyReplicas"] < s["desiredReplicas"]]
    if missing:
        return out, (CONDITION, False, "AdaptersLoading", f"not yet on every runtime pod: {', '.join(missing)}")
    return out, (CONDITION, True, "AdaptersLoaded", f"{len(out)} adapters on every runtime pod")


def _owned_by_pool(pod: dict[str, Any], instance: str) -> bool:
    """The pod is controlled by a ReplicaSet of one of our runtime Deployments (not just labelled like one)."""
    role = pod["metadata"].get("labels", {}).get(names.ROLE_LABEL, "")
    owner = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), {})
    return (role in names.RUNTIME_ROLES and owner.get("kind") == "ReplicaSet"
            and owner.get("name", "").startswith(names.pool_name(instance, role) + "-"))


class AdapterSync:
    """The operator's adapter rounds (one aiohttp session; Events reported once)."""

    def __init__(self, kube: Any) -> None:
        self.kube = kube
        self.session: aiohttp.ClientSession | None = None
        self.reported: dict[tuple[str, str], set[tuple[str, str, str]]] = {}  # (ns, isvc) -> {(pod uid, name, msg)}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def forget(self, ns: str, name: str) -> None:
        self.reported.pop((ns, name), None)

    async def sync(self, body: dict[str, Any], spec: InferenceServiceSpec, desired: dict[str, str]) -> list[PodAdapters]:
        """One round over the ready runtime pods of ``body``; ``desired`` maps adapter names to in-pod paths."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        pods = await self.kube.list_pods(ns, {names.INSTANCE_LABEL: name, names.COMPONENT_LABEL: "runtime"})
        pods = [p for p in pods if pod_helpers.is_ready(p) and _owned_by_pool(p, name)
                and pod_helpers.runtime_url(p, "") is not None]
        headers = {}
        if pods and spec.runtime.api_key_secret_ref is not None:
            key = await self._secret(ns, spec.runtime.api_key_secret_ref.name, spec.runtime.api_key_secret_ref.key)
            if key:
                headers["Authorization"] = f"Bearer {key}"
        results = list(await asyncio.gather(*(self._sync_pod(p, desired, headers) for p in pods)))
        await self._report(body, results)
        return results

    async def _secret(self, ns: str, secret: str, key: str) -> str | None:
        try:
            obj = await self.kube.get("Secret", ns, secret)
        except ApiException as e:
            log.warning("%s/%s: cannot read the runtime API key: HTTP %s", ns, secret, e.status)
            return None
        value = ((obj or {}).get("data") or {}).get(key)
        return base64.b64decode(value).decode() if value else None

    async def _call(self, method: str, url: str, headers: dict[str, str], timeout: float,
                    payload: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(HTTP status, parsed JSON or text); raises aiohttp.ClientError / asyncio.TimeoutError."""
        assert self.session is not None
        async with self.session.request(method, url, json=payload, headers=headers, allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.content.read(MAX_BODY)
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode("utf-8", "replace")

    async def _sync_pod(self, pod: dict[str, Any], desired: dict[str, str], headers: dict[str, str]) -> PodAdapters:
        meta = pod["metadata"]
        base = pod_helpers.runtime_url(pod, "")
        try:
            code, models = await self._call("GET", f"{base}/v1/models", headers, LIST_TIMEOUT)
            if code != 200 or not isinstance(models, dict):
                return PodAdapters(meta["name"], meta["uid"], unreachable=f"GET /v1/models: HTTP {code}")
            loaded = {m["id"]: m.get("root") for m in models.get("data") or []
                      if isinstance(m, dict) and m.get("parent") and isinstance(m.get("id"), str)}
            load, unload = plan(desired, loaded)
            for n in unload:
                code, answer = await self._call("POST", f"{base}/v1/unload_lora_adapter", headers, LIST_TIMEOUT,
                                                {"lora_name": n})
                if code in (200, 404):
                    loaded.pop(n, None)
                    log.info("pod %s: unloaded LoRA adapter %s", meta["name"], n)
            errors = {}
            for n, path in load:
                code, answer = await self._call("POST", f"{base}/v1/load_lora_adapter", headers, LOAD_TIMEOUT,
                                                {"lora_name": n, "lora_path": path})
                if code == 200:
                    loaded[n] = path
                    log.info("pod %s: loaded LoRA adapter %s from %s", meta["name"], n, path)
                else:
                    errors[n] = _message(code, answer)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return PodAdapters(meta["name"], meta["uid"], unreachable=f"{type(e).__name__}: {e}"[:MAX_MESSAGE])
        have = frozenset(n for n, path in loaded.items() if desired.get(n) == path)
        return PodAdapters(meta["name"], meta["uid"], have, errors)

    async def _report(self, body: dict[str, Any], results: list[PodAdapters]) -> None:
        meta = body["metadata"]
        key, uids = (meta["namespace"], meta["name"]), {r.uid for r in results}
        seen = self.reported[key] = {s for s in self.reported.get(key, set()) if s[0] in uids}  # gone pods: forget
        for r in results:
            for adapter, message in r.errors.items():
                if (r.uid, adapter, message) in seen:
                    continue
                seen.add((r.uid, adapter, message))
                text = f"adapter {adapter} on pod {r.pod}: {message}"
                log.warning("%s/%s: %s", meta["namespace"], meta["name"], text)
                try:
                    await self.kube.post_event(body, "Warning", "LoRALoadFailed", text)
                except (ApiException, aiohttp.ClientError, asyncio.TimeoutError) as e:  # an Event is best effort
                    log.warning("could not post the LoRALoadFailed Event: %s", e)


def _message(code: int, answer: Any) -> str:
    """The pod's reason from an OpenAI-shaped error body, else the status and text."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message"))[:MAX_MESSAGE]
    return f"HTTP {code}: {str(answer)[:200]}"
