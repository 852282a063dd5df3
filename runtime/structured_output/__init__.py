"""Grammar-constrained decoding: params (what a request asks), backends (xgrammar, llguidance), the engine's manager."""

from pdserve.runtime.structured_output.manager import (BACKEND_CHOICES, GrammarBitmask, StructuredOutputManager,
                                                       with_backend)
from pdserve.runtime.structured_output.params import StructuredOutputsParams

__all__ = ["BACKEND_CHOICES", "GrammarBitmask", "StructuredOutputManager", "StructuredOutputsParams", "with_backend"]
