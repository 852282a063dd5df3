"""LoRA affinity scorer: send an adapter's requests to pods that already have it (as GIE's lora-affinity scorer).

Pods publish ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` (comma-separated
names); the health loop scrapes it into ``Endpoint.lora_running`` / ``lora_waiting`` / ``max_loras``, and the base
model's name from the ``model_name`` label of the load metrics. For a request whose ``model`` is an adapter:

* 1.0 — the adapter is running or waiting on the pod (its weights are there; no slot swap);
* 0.8 — the pod has a free adapter slot (``running + waiting < max_lora``): loading it evicts nothing;
* 0.0 — the pod would have to queue it behind its other adapters.

Pods also publish ``pdserve:lora_adapter_info{lora_name, lora_digest}``: the digest of each adapter's weights, which
the engine puts into its block hashes; the router does the same (``RequestContext.hashes_for``), so the prefix scorers
never credit a pod with base-model blocks for an adapter request or the other way round.

Requests for the base model (or when no pod serves adapters) score 0 everywhere: the same for every pod, the scorer
has no say and adds nothing to the profile's totals.
"""

from __future__ import annotations

import re

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import RequestContext, Scorer, register

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
ACTIVE, CAPACITY, FULL = 1.0, 0.8, 0.0


def parse_lora_info(text: str) -> dict:
    """``{"lora_running", "lora_waiting", "max_loras", "lora_digests", "base_model"}`` from a pod's /metrics text (keys
    present only when the pod reports them; ``lora_digests`` whenever it serves adapters)."""
    out: dict = {}
    digests: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:lora_adapter_info{"):
            labels = dict(_LABEL.findall(line[line.index("{"):line.rindex("}")]))
            if labels.get("lora_name") and labels.get("lora_digest"):
                digests[labels["lora_name"]] = labels["lora_digest"]
        elif line.startswith("vllm:lora_requests_info{"):
            labels = dict(_LABEL.findall(line[line.index("{"):line.rindex("}")]))
            out["lora_running"] = frozenset(x for x in labels.get("running_lora_adapters", "").split(",") if x)
            out["lora_waiting"] = frozenset(x for x in labels.get("waiting_lora_adapters", "").split(",") if x)
            try:
                out["max_loras"] = int(labels.get("max_lora", "0"))
            except ValueError:
                out["max_loras"] = 0
        elif "base_model" not in out and line.startswith("vllm:num_requests_waiting{"):
            name = dict(_LABEL.findall(line[line.index("{"):line.rindex("}")])).get("model_name")
            if name:
                out["base_model"] = name
    if "max_loras" in out:
        out["lora_digests"] = digests
    return out


def adapter_of(model: object, pods: list[Endpoint]) -> str | None:
    """The adapter a request's ``model`` names; None for the base model, or when no pod serves adapters."""
    if not isinstance(model, str) or not any(p.max_loras for p in pods) or any(model == p.base_model for p in pods):
        return None
    return model


@register("lora-affinity")
class LoRAAffinityScorer(Scorer):
    def score(self, ctx: RequestContext, pods: list[Endpoint]) -> list[float]:
        model = adapter_of(ctx.body.get("model") if isinstance(ctx.body, dict) else None, pods)
        if model is None:
            return [0.0] * len(pods)
        scores = []
        for p in pods:
            if model in p.lora_running or model in p.lora_waiting:
                scores.append(ACTIVE)
            elif len(p.lora_running | p.lora_waiting) < p.max_loras:
                scores.append(CAPACITY)
            else:
                scores.append(FULL)
        return scores
