"""What the engine returns per request and step. Outputs are cumulative: full text and token ids so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.runtime.spec_stats import SpecDecodingStats

# logprobs of one generated position: token id -> logprob (the sampled token plus the top-k alternatives)
PositionLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    kv_transfer: dict[str, Any] | None = None   # remote-KV load: connector, start/end, blocks, bytes, failures


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache or loaded from remote KV
    kv_transfer_params: dict[str, Any] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None              # set when finish_reason == "error"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineStats:
    """The engine's counters, one snapshot per step (``LLMEngine.get_stats``), read by /metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float          # 0..1, blocks held by requests
    prefix_cache_queries: int      # tokens, cumulative
    prefix_cache_hits: int         # tokens, cumulative
    num_preemptions: int
    prompt_tokens: int             # prompt tokens computed (cumulative; prefix hits excluded)
    generation_tokens: int
    kv_load_failures: int
    recomputed_tokens: int
    num_blocks: int = 0
    prefix_cache_partial_hits: int = 0   # of the hits, tokens copied from a cached block's leading ones (cumulative)
    running_lora_adapters: list[str] | None = None   # adapter names of running / waiting requests (LoRA enabled)
    waiting_lora_adapters: list[str] | None = None
    spec_decode: SpecDecodingStats | None = None   # None: speculative decoding is off
