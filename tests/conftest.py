"""Suite-wide setup, run before any test module is collected.

Triton chooses compiled vs interpreted mode when it is first imported, and importing transformers' model classes imports
it; so the CPU interpreter switch is set here, before any test directory's modules import anything.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
