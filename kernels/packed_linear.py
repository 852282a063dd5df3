"""Dense bf16/fp16 linears on CPU with the weight pre-packed once into oneDNN's blocked layout.

Why: ``F.linear`` on a bf16 CPU tensor re-reads the plain (N, K) weight through oneDNN's matmul every call; at the
small token counts of decode (a handful to a few dozen rows) that path runs well below the memory bandwidth the
weights need. oneDNN's own linear over a weight reordered once at load (the op torch's inductor uses for frozen CPU
graphs, ``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``) reads the blocked layout directly: measured
on an AVX512-BF16 core with the default model's shapes, all 30 layers' GEMMs at 4 / 8 / 32 rows take 0.4x / 0.6x /
0.8x the time of ``F.linear``, and the same at 1 and 512 rows. In bf16 its output equals ``F.linear``'s bit for bit
from 2 rows on (both are oneDNN GEMMs); at 1 row ``F.linear`` takes a GEMV path that rounds ~0.1% of outputs 1 ulp
apart.

Only for 16-bit activations: in float32 oneDNN's kernel sums in another order than MKL's sgemm, and float32 output must
stay token-for-token equal to transformers. ``pack_linears`` is the one entry point; nothing else needs to know.
In bf16 on a CPU with AMX it packs for pdserve's AMX kernel as well (kernels/amx_linear.py: faster at decode's 1-32
rows, bit-equal to oneDNN there; more rows stay on oneDNN, so the weights are held twice), unless
``PDSERVE_CPU_AMX_LINEAR=0``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_DTYPES = (torch.bfloat16, torch.float16)


def packing_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when linears on ``device`` with ``dtype`` can be packed, else why not (for the start-up log)."""
    if torch.device(device).type != "cpu":
        return "not a CPU device"
    if dtype not in _DTYPES:
        return f"{dtype} activations (oneDNN's packed kernel is not bit-equal to F.linear in float32)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN linear ops"
    if not _self_check(dtype):   # e.g. bf16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT (AMD Zen 2/3): oneDNN refuses
        return f"oneDNN's packed {str(dtype).removeprefix('torch.')} linear fails or differs from F.linear on this CPU"
    return None


class PackedLinear(nn.Module):
    """``x (..., K) -> x @ w.T + b (..., N)`` with ``w`` held only in oneDNN's packed layout (an opaque tensor, so it
    is an attribute, not a parameter: it never enters a state dict or a device move)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.opaque_weight_bytes = weight.nbytes   # for quantization.weight_bytes: the packed tensor has no storage
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.lru_cache(maxsize=None)
def _self_check(dtype: torch.dtype, kind: type[nn.Module] = PackedLinear) -> bool:
    """The packed op equals F.linear on a small odd-shaped problem (guards against a torch build that ships the ops
    but computes differently, e.g. without native bf16 dot products)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 40, generator=g).to(dtype)
    b = torch.randn(72, generator=g).to(dtype)
    x = torch.randn(5, 40, generator=g).to(dtype)
    try:
        return torch.equal(kind(w, b)(x), F.linear(x, w, b))
    except RuntimeError:
        return False


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace every plain ``nn.Linear`` under ``model`` by a :class:`PackedLinear` (or an ``AmxLinear``), and give a
    model whose LM head is tied to a float embedding (``lm_head is None``) a packed copy of it as ``lm_head``. Returns
    how many were packed (0 when :func:`packing_supported` says no). Quantized linears are left alone."""
    reason = packing_supported(device, dtype)
    if reason is not None:
        log.info("dense GEMMs: F.linear (%s)", reason)
        return 0
    kind, kernel = _kernel(dtype)
    # the LM head stays in the AMX kernel's plain tiles: the greedy head (kernels/greedy_head_cpu.py) reads them
    head = {} if kind is PackedLinear else {"lossless": False}
    count = replace_linears(model, _DTYPES, lambda parent, name, child: kind(
        child.weight, child.bias, **(head if parent is model and name == "lm_head" else {})))
    embed = getattr(model, "embed_tokens", None)
    if (hasattr(model, "lm_head") and model.lm_head is None and getattr(model, "quant_head", None) is None
            and type(embed) is nn.Embedding and embed.weight.dtype in _DTYPES):
        model.lm_head = kind(embed.weight, None, **head)   # a copy: the embedding lookup keeps the plain rows
        count += 1
    log.info("dense GEMMs: %d linears packed for %s (%s)", count, kernel, str(dtype).removeprefix("torch."))
    return count


def replace_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...],
                    make: Callable[[nn.Module, str, nn.Linear], nn.Module]) -> int:
    """Replaces every plain ``nn.Linear`` under ``model`` whose weight is of ``dtypes`` by ``make(parent, its name
    there, it)``; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in dtypes:
                setattr(parent, name, make(parent, name, child))
                count += 1
    return count


def _kernel(dtype: torch.dtype) -> tuple[type[nn.Module], str]:
    """bf16 on a CPU with AMX: pdserve's AMX kernel (faster at decode's few rows: kernels/amx_linear.py), unless
    switched off, unbuildable or failing its self-check; else oneDNN's packed kernel."""
    from pdserve.kernels import amx_linear
    from pdserve.runtime import envs

    if dtype != torch.bfloat16 or not envs.cpu_amx_linear() or amx_linear.load_extension() is not None:
        return PackedLinear, "oneDNN"
    if not _self_check(dtype, amx_linear.AmxLinear):
        log.warning("the AMX linear kernel differs from F.linear on this CPU; bf16 linears stay on oneDNN")
        return PackedLinear, "oneDNN"
    return amx_linear.AmxLinear, "AMX"
