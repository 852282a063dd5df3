"""``--quantization``: which weights stay quantized, and how a float checkpoint is quantized at load.

``auto``  the checkpoint decides: a compressed-tensors checkpoint is served quantized with its own scheme; everything
          else, including GGUF files and the default model, is dequantized at load as before (the dense bf16 engine
          is the default's speed baseline). Ask for ``int4`` to keep the shipped Q4_1 blocks (~4x smaller). On CPUs
          without AVX-512, where the dense model runs float32, it also keeps those blocks' codes next to the dense
          weights and runs steps of 1-8 rows on them (kernels/gguf_codes_linear.py: bit-exact weights, +21% memory).
``none``  dequantize everything to ``--dtype`` (compressed-tensors too).
``int4``  GGUF: Q4_0/Q4_1/Q8_0 tensors kept as stored (exact mapping); float checkpoints and float GGUF tensors:
          linear layers quantized group-wise at load (asymmetric, 4 bits, group 128/64/32 - the largest dividing K).
``int8``  linear layers per-channel symmetric int8, quantized at load from the (dequantized) float weights.

The embedding and the LM head keep the format's own precision: a GGUF Q8_0 embedding stays Q8_0 (its tied LM head
runs on the same codes); a float checkpoint's embedding and LM head stay float, as in vLLM's weight-only schemes.

Compute dtype and kernel (kernels/linear_*.py, picked by the registry):

* ``--dtype auto`` with quantized weights on CPU computes in bfloat16 on torch's int4/int8 kernels (``int4_cpu``,
  ``int8_cpu``): torch's int4 CPU kernel is vectorized for bfloat16 only. Fast, close, not exact.
* ``--dtype float32`` runs ``f32_cpu`` (kernels/linear_f32_cpu.py): a fused dequantize-GEMM torch extension with
  float32 activations, scales, zeros and output - nothing rounded to bf16. Not exact by construction (float32 sums in
  another order, ~1e-6 of a layer's output), but greedy output equals transformers on the dequantized weights token
  for token on the parity prompts for every format, ~4.8x smaller than float32, and faster than the bf16 engine at
  batch 1. Where it cannot be built (no compiler) it falls back to ``dequant`` with one log line.
* ``PDSERVE_LINEAR_METHOD=dequant`` (with float32): codes stay quantized, each forward rebuilds the float32 weight bit
  for bit as the reference dequantization does, then the dense GEMM - exact by construction, but slow.

Why the bf16 kernels miss (and ``f32_cpu`` was built for) the >= 95% free-running greedy agreement of issue 14 (measured 2026-11-23, 8 parity prompts,
32 tokens, OMP_NUM_THREADS=1). torch's CPU int4/int8 kernels are vectorized for bfloat16 only (float32 and float16
activations take scalar loops, 20-45x a dense float32 GEMM at batch 1 and 32) and return bfloat16, so the fast path
rounds three things to 8 mantissa bits: activations, scales/zeros (exact for compressed-tensors' bf16 scales, not for
GGUF's float16 ``d``), and every linear's output. Each alone flips near-ties: emulated in a float32 model with float32
GEMMs, bf16 scales alone give 87% (the first token of one prompt flips), bf16 outputs alone 97%, bf16 activations
alone 100%, bf16 scales and activations 94%. With the real kernel the output rounding is the floor: split activations
(x = hi + lo, both bf16, stacked in one call: nearly free at batch 1) plus float32-exact scales (a second call on the
bf16 remainder) leave every Q4_1 layer at ~2e-3 of its output's max (~3e-3 unsplit), and free-running agreement is
then a lottery over which near-tie flips first: 67%, 74% and 91% for those variants in a float32 model, 73% for the
bf16 engine. Nor does a fairer reference get there: transformers in bf16 on exactly the weights the kernel computes
with (its bf16 scales and zeros, float32 accumulation emulated) agrees 77% with the bf16 int4 engine; transformers
bf16 vs transformers float32: 78%; the dense bf16 engine: 79% (92.5% vs transformers bf16). What closes it is a
float32 model with a kernel that takes float32 scales and returns float32: with torch's kernel that costs 2.5x one call
(a second int4 call subtracting the first call's bf16 output inside its float32 sum via an extra group of codes:
~6e-6 error, batch 1 only), slower than a dense float32 GEMV, so not offered; the fused float32 kernel ``f32_cpu`` is
the fix (100% on the same prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pdserve.kernels.linear_base import QuantizedWeight

Quantization = Literal["auto", "none", "int8", "int4"]
QUANTIZATIONS = ("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class QuantPlan:
    """What the loader does for one model: where the weights come from and which linears get quantized at load."""

    source: Literal["float", "gguf", "compressed-tensors"]  # float: safetensors as is (dequantized if needed)
    quantize_at_load: Literal["int8", "int4"] | None         # for float linear weights
    description: str                                         # for the start-up log

    @property
    def quantized(self) -> bool:
        return self.source != "float" or self.quantize_at_load is not None


def plan(quantization: str, *, gguf_source: bool, compressed: bool) -> QuantPlan:
    """The plan for ``--quantization`` on a checkpoint that is a GGUF file and/or compressed-tensors."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if compressed:
        if quantization in ("int8", "int4"):
            raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized (compressed-tensors); "
                             "use auto to serve it as is or none to dequantize it")
        if quantization == "auto":
            return QuantPlan("compressed-tensors", None, "compressed-tensors, kept quantized")
        return QuantPlan("float", None, "compressed-tensors, dequantized at load")
    if quantization == "int4" and gguf_source:
        return QuantPlan("gguf", "int4", "GGUF blocks kept quantized (float linears -> int4)")
    if quantization in ("int8", "int4"):
        return QuantPlan("float", quantization, f"weight-only {quantization}, quantized at load")
    return QuantPlan("float", None, "none" if not gguf_source else "GGUF dequantized at load")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Per-channel symmetric int8: ``scale = max|w_n| / 127``, ``q = round(w / scale)``."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)          # (N, 1)
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q, scale, None, w.shape[1], 8, "int8 (quantized at load)")


def int4_group_size(k: int) -> int:
    g = next((g for g in (128, 64, 32) if k % g == 0), None)
    if g is None:
        raise ValueError(f"int4 needs in_features divisible by 32, got {k}")
    return g


def quantize_int4(w: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Group-wise asymmetric 4-bit: per group ``scale = (max - min) / 15``, ``w ~ scale * q + min``, q in [0, 15]."""
    w = w.float()
    n, k = w.shape
    g = group_size or int4_group_size(k)
    wg = w.view(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)                                            # (N, G)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight(q, scale, lo, g, 4, f"int4 g{g} (quantized at load)")


class QuantEmbedding(nn.Module):
    """Embedding lookup on quantized rows: gathers the codes of the looked-up tokens and dequantizes only those."""

    def __init__(self, w: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.group_size, self.dtype = w.group_size, dtype
        self.register_buffer("q", w.q.to(device))                                 # (V, H)
        self.register_buffer("scale", w.scale.to(device))                         # (V, H / group)
        self.register_buffer("zero", None if w.zero is None else w.zero.to(device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = QuantizedWeight(self.q[ids], self.scale[ids], None if self.zero is None else self.zero[ids],
                               self.group_size, 8, "")
        return rows.dequantize(self.dtype)                                        # (T, H): same float32 math as the reference

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.buffers())


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights really occupy: parameters plus persistent buffers (packed codes, scales), a tensor
    shared by two modules counted once (the ``dequant`` tied LM head reads the embedding's own codes and scales), plus
    the ``opaque_weight_bytes`` of modules holding a weight torch cannot see (kernels/packed_linear.py)."""
    tensors = list(model.parameters())
    for mod in model.modules():
        tensors += [b for n, b in mod.named_buffers(recurse=False)
                    if b is not None and n not in mod._non_persistent_buffers_set]
    opaque = sum(getattr(mod, "opaque_weight_bytes", 0) for mod in model.modules())
    return opaque + sum(nbytes for _, nbytes in {(t.data_ptr(), t.nbytes) for t in tensors})
