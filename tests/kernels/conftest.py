"""Kernel tests run Triton in its CPU interpreter when there is no GPU. Triton picks compiled vs interpreted when its
modules are first imported, so the switch is set here, at collection, before any test module imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
