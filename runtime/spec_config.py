"""Speculative decoding configuration (``--speculative-config`` JSON, ``LLM(speculative_config=...)``), vLLM-shaped::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "<path or id>", "num_speculative_tokens": 3}

pdserve extensions: ``"draft_num_layers": N`` keeps only the draft's first N decoder layers (then its final norm and
LM head, shared). With ``model`` omitted (or equal to the target's), the draft shares the target's weights, so
``{"method": "draft_model", "draft_num_layers": 12}`` is a free, cheaper self-draft. ``"disable_by_batch_size": N``
(vLLM v0's knob) proposes nothing while N or more requests run, where verifying drafts costs more compute than it
saves latency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

Method = Literal["ngram", "draft_model"]


@dataclass(frozen=True)
class SpeculativeConfig:
    method: Method = "ngram"
    num_speculative_tokens: int = 3          # drafts proposed per request per step (k)
    prompt_lookup_min: int = 1               # ngram: shortest suffix n-gram looked up
    prompt_lookup_max: int = 4               # ngram: longest suffix n-gram looked up (tried first)
    model: str | None = None                 # draft_model: None -> the target model's own weights
    draft_num_layers: int | None = None      # draft_model: keep the first N layers (pdserve extension)
    disable_by_batch_size: int | None = None  # no drafts in steps with at least this many running requests (vLLM v0)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative_config.num_speculative_tokens must be at most 16")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
        for name in ("draft_num_layers", "disable_by_batch_size"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {n!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a JSON string or dict (unknown keys refused by name); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if value.get("method", "ngram") == "ngram" and value.get("model") is not None:
            raise ValueError("speculative_config.model is only for method 'draft_model'")
        return cls(**value)
