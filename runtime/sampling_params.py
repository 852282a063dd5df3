"""Sampling parameters of one request (vLLM-shaped). Validation raises ValueError with a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_strings = tuple(stop)
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop", "must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
