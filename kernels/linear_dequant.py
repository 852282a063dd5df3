"""Dequantize-then-GEMM linear: codes stay quantized in memory, each forward rebuilds the float weight and runs F.linear.

The rebuild is ``scale * q + zero`` in float32, the very operations ``QuantizedWeight.dequantize`` (and, for GGUF,
gguf-py) performs, so the weight is bit for bit the dequantized reference and the output is exactly what a dense
float32 model on the dequantized checkpoint computes: greedy output equals transformers token for token BY
CONSTRUCTION. This is the method for float32 (and float16) activations on CPU, where torch's int4/int8 CPU kernels
take a scalar path slower than this rebuild; bfloat16 activations run on ``int4_cpu`` / ``int8_cpu`` (fast, not exact).

Memory: 4-bit codes packed two per byte, 8-bit codes one per byte, float32 scales (and zeros) per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.linear_base import LinearMethod, QuantizedWeight, QuantLinearModule, register_linear_method


class DequantLinear(QuantLinearModule):
    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size, self.bits, self.code_dtype, self.dtype = w.group_size, w.bits, w.q.dtype, dtype
        q = w.q
        if w.bits == 4:  # two codes a byte; signed codes are stored offset by 8 and restored on unpack
            u = (q.to(torch.int16) + (8 if q.dtype == torch.int8 else 0)).to(torch.uint8).view(-1, 2)
            q = u[:, 0] | (u[:, 1] << 4)
        self.register_buffer("codes", q.contiguous().to(device))
        self.register_buffer("scale", w.scale.float().contiguous().to(device))            # (N, K/g)
        self.register_buffer("zero", None if w.zero is None else w.zero.float().contiguous().to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def weight(self) -> torch.Tensor:
        """The float weight (N, K), bit-identical to ``QuantizedWeight.dequantize(dtype)``."""
        q = self.codes
        if self.bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=-1).view(self.out_features, self.in_features)
            if self.code_dtype == torch.int8:
                q = q.to(torch.int8) - 8
        return QuantizedWeight(q, self.scale, self.zero, self.group_size, self.bits, "").dequantize(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)


@register_linear_method("dequant")
class DequantMethod(LinearMethod):
    name = "dequant"

    def supports(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype == torch.bfloat16 and device.type == "cpu":
            return "bfloat16 on CPU runs on the int4/int8 kernels"
        if weight.shape[1] % weight.group_size or (weight.bits == 4 and weight.q.numel() % 2):
            return f"needs in_features divisible by the group size (got {weight.shape[1]}, {weight.group_size})"
        return None

    def create(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> QuantLinearModule:
        return DequantLinear(weight, bias, device, dtype)
