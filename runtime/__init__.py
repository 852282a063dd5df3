"""pdserve.runtime: the paged-KV inference engine. ``from pdserve.runtime import LLM, SamplingParams``.

Read it in this order: config (``config``, ``envs``) -> request (``request``, ``sampling_params``, ``validation``) ->
block hashing (``block_hash``) -> block pool (``block_pool``) -> kv cache manager (``kv_cache_manager``) ->
scheduler (``scheduler``, + kv transfer tracker ``kv_transfer_tracker``, stop checker ``stop_checker``, admission /
preemption policy ``sched_policy``, what the runner holds ``runner_view``) -> seam types (``sched_output``) -> model
runner (``model_runner``, + persistent batch ``input_batch``, ``models/``) -> sampler (``sampler``) -> detokenizer
(``detokenizer``) -> engine (``engine``, + n > 1 fan-out ``fan_out``, output processor ``output_processor``; its
stats and outputs in ``outputs``) -> async engine (``async_engine``) -> server
(``engine_client`` seam, ``server_state``, ``routes``, ``request_mapping``, ``json_body``, ``streaming``, ``drain``,
``api_server``) -> CLI (``cli``).

Features plug into those seams, each in its own modules: quantized weights (``quantization``, ``gguf_weights``,
``compressed_tensors``, ``kernels/linear_*``), structured outputs and tools (``structured_output/``, ``tool_calling/``:
requests wait outside the scheduler while their grammar compiles (``structured_output.engine_hooks``), a grammar
bitmask in the SchedulerOutput, applied by the sampler), LoRA (``lora_adapter``, ``lora_manager``,
``lora_routes``, ``kernels/lora``: a LoRA id per NewRequestData and batch row), speculative decoding (``spec_config``,
``spec_propose``, ``rejection_sampler``, ``spec_stats``: drafts in ``scheduled_spec_decode_tokens``).

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
