"""The server's LoRA surface, shaped like vLLM's: flags, model resolution, adapter management routes, metrics.

* ``--enable-lora --max-loras N --max-lora-rank R --max-cpu-loras M --lora-modules name=path ...`` (or the JSON form
  ``'{"name": ..., "path": ..., "base_model_name": ...}'``; runtime/cli.py -> ``LoRAConfig``): the engine registers
  them at start, and a broken one stops the start with its reason.
* A request selects an adapter by ``model`` (vLLM): the base name -> base model, an adapter name -> that adapter, an
  unknown name -> 404 (``NotFoundError`` shape) while LoRA is on.
* ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}`` exist
  only when ``PDSERVE_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is true, behind the
  same API key as every /v1 route. An adapter that cannot be served -> 400 with the reason; the server keeps serving.
* ``/v1/models`` lists adapters with ``parent`` (their base model) and ``root`` (their directory).
* Metrics: ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` (value: the time of the
  sample, as vLLM), ``pdserve:lora_requests{lora_name}`` (requests admitted per adapter) and
  ``pdserve:lora_adapter_info{lora_name, lora_digest}`` (1 per registered adapter: the digest of its weights, which the
  router's prefix scorer puts into its block hashes as the engine does).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, StrictStr

from pdserve.runtime import envs
from pdserve.runtime.protocol import ApiError, parse


# ---- requests ----------------------------------------------------------------------------------------------------------
def resolve(engine: Any, model: str | None, base_names: set[str]) -> str | None:
    """The adapter a request's ``model`` selects (None: the base model). ApiError 404/400 for an unknown name."""
    if model is None or model in base_names:
        return None
    lora = engine.lora
    if lora is not None:
        if model in lora:
            return model
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    raise ApiError(400, f"model {model!r} not found; this server serves {engine.served_model_name!r}",
                   param="model", code="model_not_found")


def model_cards(engine: Any, created: int) -> list[dict[str, Any]]:
    lora = engine.lora
    if lora is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "pdserve",
             "root": path, "parent": base or engine.served_model_name,
             "max_model_len": engine.max_model_len} for name, path, base in lora.names()]


# ---- management routes -------------------------------------------------------------------------------------------------
class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr
    lora_int_id: int | None = None


def install_routes(app: FastAPI, state: Any, guarded: list, read_json: Any) -> None:
    """Adapter management routes (only with runtime updating allowed) and the LoRA metrics."""
    engine = state.engine
    if engine.lora is None:
        return
    state.metrics.registry.register(LoRACollector(engine, state.metrics))
    if not envs.allow_runtime_lora_updating():
        return
    from pdserve.runtime.lora_adapter import LoRAError
    from pdserve.runtime.lora_manager import LoRANotFound

    @app.post("/v1/load_lora_adapter", dependencies=guarded)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req: LoadLoRAAdapterRequest = parse(LoadLoRAAdapterRequest, await read_json(request))
        if req.lora_name in state.model_names:
            raise ApiError(400, f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
        try:
            # on the engine thread, between two steps (as vLLM's engine core loads adapters): torch work on any other
            # thread would give OpenMP a second worker team and slow every later step (runtime/engine_thread.py)
            await state.async_engine.call(engine.add_lora, req.lora_name, req.lora_path)
        except LoRAError as e:
            raise ApiError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=guarded)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req: UnloadLoRAAdapterRequest = parse(UnloadLoRAAdapterRequest, await read_json(request))
        try:
            engine.remove_lora(req.lora_name)
        except LoRANotFound as e:
            raise ApiError(404, str(e), param="lora_name", code="lora_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


# ---- metrics -----------------------------------------------------------------------------------------------------------
class LoRACollector(Collector):
    """Reads the engine stats the engine thread publishes (``EngineStats.lora_*``) and the manager's counters."""

    def __init__(self, engine: Any, metrics: Any) -> None:
        self.engine, self.metrics = engine, metrics

    def collect(self) -> Iterator[Any]:
        stats = self.metrics.latest_stats
        running = ",".join(sorted(getattr(stats, "running_lora_adapters", None) or []))
        waiting = ",".join(sorted(getattr(stats, "waiting_lora_adapters", None) or []))
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(self.engine.config.lora.max_loras), running, waiting], time.time())
        yield info
        total = CounterMetricFamily("pdserve:lora_requests", "Requests admitted per LoRA adapter.",
                                    labels=["model_name", "lora_name"])
        for name, n in sorted(self.engine.lora.request_counts().items()):
            total.add_metric([self.metrics.model_name, name], float(n))
        yield total
        adapters = GaugeMetricFamily("pdserve:lora_adapter_info", "Registered LoRA adapters and the digest of their "
                                     "weights (the prefix-cache identity).", labels=["lora_name", "lora_digest"])
        for name, digest in sorted(self.engine.lora.digests().items()):
            adapters.add_metric([name, digest], 1.0)
        yield adapters
