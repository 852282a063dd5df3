"""The engine the greedy parity tests compare against (transformers, or the same engine without a feature): float32,
so tokens are exact across batch shapes (bf16 is not batch-invariant), and room for the 20 parity prompts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

PARITY_ENGINE = dict(dtype="float32", max_model_len=2048, num_gpu_blocks=1024)


@contextmanager
def parity_llm(**overrides) -> Iterator:
    """An ``LLM`` with ``PARITY_ENGINE``'s settings (``overrides`` win), shut down on exit."""
    from pdserve.runtime import LLM

    llm = LLM(**{**PARITY_ENGINE, **overrides})
    try:
        yield llm
    finally:
        llm.shutdown()
