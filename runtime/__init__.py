"""pdserve.runtime: the paged-KV inference engine. ``from pdserve.runtime import LLM, SamplingParams``.

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
