"""Float32 dense linears of a few rows on CPUs without AVX-512: ``y = (W X^T)^T`` instead of ``X W^T``.

Why: a decode step of 2-16 sequences multiplies 2-16 rows by every weight, so its linears should cost one read of the
weights from memory. torch's ``F.linear`` (MKL's sgemm) at those shapes reads them at well under the memory's speed on
a 2-core AMD EPYC (Zen 3, AVX2): the default model's 120 decoder linears take 49-55 ms at 2-16 rows against 30 ms at
one row. The same sgemm with the operands' roles swapped (the weight as the left-hand matrix, the few rows as the
right-hand columns) takes 21-22 ms at 2-4 rows and 36-44 ms at 8-16: 2.3x and 1.26x (benchmarks/RESULTS.md). From 32
rows on, and at one row, the two run alike; a prefill's hundreds of rows run faster as ``F.linear``.

Numerics: both are MKL's float32 sgemm over the same K; at 1 and 16+ rows the outputs are bit-equal, at 2-8 rows
they differ by float32 rounding (~5e-7 of the output), as batched rows already differ from a single row's GEMV.
Greedy float32 output keeps transformers' tokens (the engine parity tests run on it where it applies).

Only where measured: float32 on CPUs without AVX-512 (there bf16 is emulated and ``--dtype auto`` picks float32); an
AVX-512 host runs bf16 by default, with its own kernels. ``PDSERVE_CPU_SMALL_ROWS_GEMM=0`` keeps ``F.linear``.
``SmallRowsLinear.served`` counts the calls it served.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.packed_linear import replace_linears

log = logging.getLogger(__name__)

ROWS = range(2, 17)   # the row counts served; elsewhere F.linear


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products of 2-16 rows run as ``(W X^T)^T``."""

    served = 0

    @classmethod
    def of(cls, linear: nn.Linear) -> "SmallRowsLinear":
        """One holding ``linear``'s own parameters (not copies)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if rows not in ROWS:
            return F.linear(x, self.weight, self.bias)
        SmallRowsLinear.served += 1
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def applies(device: torch.device, dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether linears on ``device`` in ``dtype`` take this path: float32 on a CPU without AVX-512 (``flags``: the
    CPU's, for tests), unless switched off."""
    from pdserve.runtime import envs
    from pdserve.runtime.cpu_features import cpu_flags

    flags = cpu_flags() if flags is None else flags
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and "avx512f" not in flags
            and envs.cpu_small_rows_gemm())


def swap_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Makes every plain float32 ``nn.Linear`` under ``model`` a :class:`SmallRowsLinear` (its own parameters, not
    copies) where :func:`applies`; returns how many."""
    if not applies(device, dtype):
        return 0
    count = replace_linears(model, (torch.float32,), lambda parent, name, child: SmallRowsLinear.of(child))
    log.info("dense GEMMs: %d float32 linears run 2-16 rows as (W X^T)^T", count)
    return count
