"""Group-wise int4 weight-only linear on CPU: torch's ``_weight_int4pack_mm_for_cpu``.

The kernel's formula (checked against torch 2.15 in tests/runtime/test_quantization_kernels.py)::

    w[n, k] = s[k // G, n] * (u[n, k] - 8) + z[k // G, n]        u in [0, 15], G in {32, 64, 128, 256}

with ``u`` packed by ``_convert_weight_to_int4pack_for_cpu`` ((N, K) int32 -> (N, K/2) uint8) and ``(s, z)`` stacked as
``qScaleAndZeros`` (K/G, N, 2) in the activation dtype. Our ``scale * q + zero`` maps onto it exactly:

* unsigned codes (GGUF Q4_0/Q4_1, asymmetric quantization): ``u = q``, ``s = scale``, ``z = zero + 8 * scale``
  (GGUF Q4_1 ``d * q + m`` -> ``s = d``, ``z = m + 8d``; Q4_0 ``d * (q - 8)`` -> ``s = d``, ``z = 0``);
* signed codes in [-8, 7] (compressed-tensors W4A16): ``u = q + 8``, ``s = scale``, ``z = zero``.

A group size the kernel does not take (per-channel, or 16) is re-expressed with a smaller group by repeating the
scales, which is exact. Group-wise 8-bit codes (GGUF Q8_0: ``d * q``, q in [-128, 127], 32 per block) have no torch CPU
kernel; they run as two int4 matmuls on the nibbles ``q = 16 h + l`` (h in [-8, 7], l in [0, 15]):
``d q = (16 d) h + d l`` - exact in real arithmetic, at 1.25 bytes per weight.

Speed: on AVX-512 hosts the kernel is vectorized for bfloat16 activations (several times faster than a dense bf16
GEMV at batch 1); float32 activations take a slow scalar path. ``--dtype auto`` therefore computes in bfloat16 when
weights are quantized on CPU (see runtime/quantization.py). bf16 rounds the scales and zeros to 8 mantissa bits (exact
for compressed-tensors' bf16 scales, not for GGUF's float16 ``d``), but the larger error is the kernel's bf16 output.
"""

from __future__ import annotations

import torch

from pdserve.kernels.linear_base import (DeviceLinearMethod, KernelLinear, QuantizedWeight, QuantLinearModule,
                                         register_linear_method)

_GROUPS = (256, 128, 64, 32)


def _kernel_group(group_size: int) -> int | None:
    """The largest group size the kernel takes that divides ``group_size`` (scales repeat exactly), or None."""
    return next((g for g in _GROUPS if group_size % g == 0), None)


class Int4Linear(KernelLinear):
    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        n, k = w.shape
        self.out_features, self.in_features = n, k
        g = _kernel_group(w.group_size)
        assert w.bits == 4 and g is not None and k % w.group_size == 0
        rep = w.group_size // g
        scale = w.scale.double().repeat_interleave(rep, dim=1)                          # (N, K/g)
        zero = torch.zeros_like(scale) if w.zero is None else w.zero.double().repeat_interleave(rep, dim=1)
        if w.q.dtype == torch.uint8:                                                    # unsigned codes in [0, 15]
            u, z = w.q.to(torch.int32), zero + 8 * scale
        else:                                                                           # signed codes in [-8, 7]
            u, z = w.q.to(torch.int32) + 8, zero
        if int(u.min()) < 0 or int(u.max()) > 15:
            raise ValueError(f"{w.fmt}: 4-bit codes out of range [{int(u.min())}, {int(u.max())}]")
        self.group_size, self.dtype = g, dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1).to(device))
        sz = torch.stack([scale.t(), z.t()], dim=-1)                                    # (K/g, N, 2)
        self.register_buffer("scale_zeros", sz.to(device=device, dtype=dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:  # (T, K) -> (T, N)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)


class Int8GroupsAsInt4Linear(QuantLinearModule):
    """Group-wise 8-bit codes as the sum of two int4 matmuls over the high and low nibbles (see module docstring)."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        q = w.q.to(torch.int16)
        hi = QuantizedWeight((q >> 4).to(torch.int8), w.scale * 16, None, w.group_size, 4, w.fmt)  # h in [-8, 7]
        lo = QuantizedWeight((q & 15).to(torch.uint8), w.scale, w.zero, w.group_size, 4, w.fmt)     # l in [0, 15]
        self.hi = Int4Linear(hi, bias, device, dtype)
        self.lo = Int4Linear(lo, None, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hi(x) + self.lo(x)


@register_linear_method("int4_cpu")
class Int4CpuMethod(DeviceLinearMethod):
    name = "int4_cpu"

    def check(self, weight: QuantizedWeight) -> str | None:
        if weight.shape[1] % 32 or _kernel_group(weight.group_size) is None:
            return f"needs in_features and the group size divisible by 32 (got {weight.shape[1]}, {weight.group_size})"
        if weight.bits == 8 and weight.group_size == weight.shape[1] and weight.zero is None:
            return "per-channel symmetric 8-bit runs on int8_cpu"
        if weight.bits not in (4, 8):
            return f"{weight.bits}-bit codes are not supported"
        if weight.shape[0] % 16:  # _convert_weight_to_int4pack_for_cpu raises on it (torch 2.15)
            return f"needs out_features divisible by 16 (got {weight.shape[0]})"
        return None

    def module_class(self, weight: QuantizedWeight) -> type[QuantLinearModule]:
        return Int4Linear if weight.bits == 4 else Int8GroupsAsInt4Linear
