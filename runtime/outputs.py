"""What the engine returns per request and step. Outputs are cumulative: full text and token ids so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
