"""Per-channel symmetric int8 weight-only linear on CPU: torch's ``_weight_int8pack_mm``.

``y = x @ (scale[n] * q[n, k]).T`` with ``q`` int8 (N, K) and ``scale`` (N,) in the activation dtype (checked against
torch 2.15 in tests/runtime/test_quantization_kernels.py). This is ``--quantization int8`` of a float checkpoint and the
compressed-tensors ``int-quantized`` channel format; group-wise 8-bit codes (GGUF Q8_0) run on ``int4_cpu`` instead.
On AVX-512 the kernel is about as fast as a dense bf16 GEMM: the gain is memory (1 byte per weight), not speed.
"""

from __future__ import annotations

import torch

from pdserve.kernels.linear_base import (DeviceLinearMethod, KernelLinear, QuantizedWeight, QuantLinearModule,
                                         register_linear_method)


class Int8Linear(KernelLinear):
    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        # Fresh copies: a tensor read from safetensors may sit at any byte offset of the file's buffer, and the
        # kernel's vector loads crash (SIGSEGV, torch 2.15, M >= 4) on an int8 weight that is not 64-byte aligned.
        self.register_buffer("q", w.q.to(device=device, dtype=torch.int8).clone(memory_format=torch.contiguous_format))
        self.register_buffer("scale", w.scale[:, 0].to(device=device, dtype=dtype).clone())  # (N,)
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:  # (T, K) -> (T, N)
        if x2.data_ptr() % 64:  # same alignment hazard as the weight (see __init__)
            x2 = x2.clone()
        return torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)


@register_linear_method("int8_cpu")
class Int8CpuMethod(DeviceLinearMethod):
    name = "int8_cpu"

    def check(self, weight: QuantizedWeight) -> str | None:
        if weight.bits != 8 or weight.group_size != weight.shape[1] or weight.zero is not None:
            return "needs per-channel symmetric 8-bit codes"
        return None

    def module_class(self, weight: QuantizedWeight) -> type[QuantLinearModule]:
        return Int8Linear
