"""LoRA filter: an adapter's requests go only to pods that have the adapter registered (not strict).

Pods publish ``pdserve:lora_adapter_info{lora_name, lora_digest}`` for every registered adapter (scraped into
``Endpoint.lora_digests``). A pod that serves LoRA but lacks the adapter would answer 404: a pod that just started and
has not been given its adapters by the operator yet (operator/lora_sync.py), or one where loading it failed. When no
pod has the adapter, the filter keeps every pod (the pods' own 404 is then the answer); base-model requests pass.
"""

from __future__ import annotations

from pdserve.router.endpoints import Endpoint
from pdserve.router.framework import Filter, RequestContext, register
from pdserve.router.plugins.lora_affinity import adapter_of


@register("lora-registered")
class LoRARegisteredFilter(Filter):
    def filter(self, ctx: RequestContext, pods: list[Endpoint]) -> list[Endpoint]:
        model = adapter_of(ctx.body.get("model") if isinstance(ctx.body, dict) else None, pods)
        if model is None:
            return pods
        return [p for p in pods if model in p.lora_digests]
