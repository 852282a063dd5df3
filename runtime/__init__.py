"""pdserve.runtime: the paged-KV inference engine. ``from pdserve.runtime import LLM, SamplingParams``.

Read it in this order: config (``config``, ``envs``) -> request (``request``, ``sampling_params``, ``validation``) ->
block hashing (``block_hash``) -> block pool (``block_pool``) -> kv cache manager (``kv_cache_manager``) ->
scheduler (``scheduler``, + kv transfer tracker ``kv_transfer_tracker``, stop checker ``stop_checker``) -> seam types
(``sched_output``) -> model runner (``model_runner``, + persistent batch ``input_batch``, ``models/``) -> sampler
(``sampler``) -> detokenizer (``detokenizer``) -> engine (``engine``) -> async engine (``async_engine``) -> server
(``routes``, ``request_mapping``, ``streaming``, ``api_server``) -> CLI (``cli``).

Exports are lazy so that torch-free modules (``pdserve.runtime.block_hash``) import without torch.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
