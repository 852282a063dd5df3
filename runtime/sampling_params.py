"""Sampling parameters of one request (vLLM-shaped). Validated on construction by
``pdserve.runtime.validation.check_sampling_params``: an ``InvalidParam`` (a ValueError) naming the field."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from pdserve.runtime.validation import check_sampling_params

GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    n: int = 1                            # completions per prompt (fanned out into n requests sharing the prompt KV)
    max_tokens: int | None = 16           # None -> up to max_model_len
    min_tokens: int = 0                   # EOS and stop_token_ids are masked until this many tokens were generated
    temperature: float = 1.0              # 0 -> greedy
    top_p: float = 1.0
    top_k: int = -1                       # -1 or 0 -> off
    min_p: float = 0.0
    seed: int | None = None               # per-request generator: same seed, same prompt -> same output
    repetition_penalty: float = 1.0       # over prompt and output tokens (HF semantics)
    presence_penalty: float = 0.0         # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None           # top-k alternatives per sampled token (0 -> only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None        # a structured_output.StructuredOutputsParams: the grammar the output follows
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_strings = tuple(stop)
        # numpy ints become ints; anything else is left for the validation to refuse
        self.stop_token_ids = [operator.index(t) if hasattr(t, "__index__") else t for t in self.stop_token_ids or []]
        if self.top_k == 0:
            self.top_k = -1
        check_sampling_params(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW  # a tinier temperature overflows float32 logits (as vLLM does)

    def held_back_token_ids(self, eos_token_id: int | None, num_output_tokens: int) -> list[int]:
        """The tokens ``min_tokens`` masks after ``num_output_tokens`` tokens: EOS and the stop token ids, or none."""
        if num_output_tokens >= self.min_tokens:
            return []
        return list(self.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
