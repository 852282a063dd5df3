"""pdserve.kernels: attention backends behind a registry (see ``base.py`` for the KV layout and the contract).

``select_backend(name, device)`` is the one place that decides which backend runs:
``None`` (auto) -> ``flash`` on CUDA when flash-attn imports, else ``triton`` on CUDA, else ``torch`` (the CPU reference).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pdserve.kernels.base import AttentionBackend, AttentionMetadata, available_backends, create_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "create_backend", "select_backend"]


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_backend(name: str | None, device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """The attention backend for ``device``: ``name`` explicitly (``torch``, ``triton``, ``flash``), or auto when None.

    ``dtype`` (the model's compute dtype, when known) keeps auto off flash-attn for float32, which it cannot run.
    Raises ``ValueError`` with the reason when an explicit backend cannot run here.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    half = dtype in (None, torch.float16, torch.bfloat16)
    if name is None:
        if cuda and half and _have("flash_attn") and "flash" in available_backends():
            return create_backend("flash")
        if cuda and _have("triton"):
            return create_backend("triton")
        return create_backend("torch")
    if name == "flash":
        if not (cuda and "flash" in available_backends()):
            raise ValueError("attention backend 'flash' needs a CUDA device and flash-attn "
                             "(`pip install 'pdserve[gpu]'`); use 'triton' or 'torch' instead")
        if not half:
            raise ValueError(f"attention backend 'flash' runs in float16/bfloat16 only, not {dtype}; "
                             "use --dtype bfloat16 or the 'triton' backend")
    if name == "triton":
        if not _have("triton"):
            raise ValueError("attention backend 'triton' needs the triton package (`pip install triton`)")
        # Triton compiles for GPUs; on CPU only its (slow) interpreter runs it, used by the tests.
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for the slow "
                             "CPU interpreter); use 'torch' on CPU")
    return create_backend(name)
