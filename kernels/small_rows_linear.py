"""Float32 dense linears of a few rows on CPUs without AVX-512: ``y = (W X^T)^T`` instead of ``X W^T``.

Why: a decode step of 2-128 sequences multiplies that many rows by every weight. torch's ``F.linear`` (MKL's sgemm)
at those shapes runs well below the CPU's speed on a 2-core AMD EPYC (Zen 3, AVX2); the same sgemm with the operands'
roles swapped (the weight as the left-hand matrix, the few rows as the right-hand columns) does not. The default
model's 120 decoder linears, 2 threads: ``F.linear`` 50 ms at 2-4 rows, 54 at 16, 95 at 32, 143 at 64, 238 at 128;
swapped 21-22, 45, 65, 106, 193. At one row the two run alike; from ~160 rows on (a prefill) ``F.linear`` is as
fast or faster (benchmarks/RESULTS.md). The tied LM head (49,152 x 576) gains the same way at 2-32 rows (18-20 ms ->
5-16 ms at 4-16); the model calls its ``head_gemm``, which :func:`swap_linears` points here.

Numerics: both are MKL's float32 sgemm over the same K; where this path does not serve the outputs are bit-equal,
where it does they differ by float32 rounding (~5e-7 of the output), as batched rows already differ from a single
row's GEMV. Greedy float32 output keeps transformers' tokens (the engine parity tests run on it where it applies).

Only where measured: float32 on CPUs without AVX-512 (there bf16 is emulated and ``--dtype auto`` picks float32); an
AVX-512 host runs bf16 by default, with its own kernels. ``PDSERVE_CPU_SMALL_ROWS_GEMM=0`` keeps ``F.linear``.
``SmallRowsLinear.served`` counts the calls it served.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import fused_f32_cpu
from pdserve.kernels.packed_linear import replace_linears

log = logging.getLogger(__name__)

ROWS = range(2, 129)   # the row counts served; elsewhere F.linear
# Rows of a tall weight per sgemm call: MKL runs the tied LM head (49,152 x 576) faster in slabs than whole, at 16-32
# rows 13.8 -> 10.9 and 18.8 -> 15.8 ms (2 threads, Zen 3); the decoder's linears gain nothing (benchmarks/RESULTS.md).
CHUNK = 3072
# Above PAD_ABOVE rows, the rows go to the sgemm zero-padded to a multiple of PAD_TO: MKL runs W X^T at a multiple of
# 16 columns far faster than at the columns around it (the default model's decoder linears, 2 threads, Zen 3: 11-15
# rows 58-91 ms vs 43 at 16; 31 rows 125 vs 62 at 32; 47: 136 vs 81 at 48), and never much slower
# (benchmarks/RESULTS.md). The padding's outputs are dropped by the transpose back.
PAD_ABOVE, PAD_TO = 8, 16


def padded(rows: int) -> int:
    """The columns the sgemm runs ``rows`` rows at: above :data:`PAD_ABOVE`, the next multiple of :data:`PAD_TO`."""
    return rows if rows <= PAD_ABOVE else -(-rows // PAD_TO) * PAD_TO


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products of 2-128 rows run as ``(W X^T)^T``."""

    served = 0

    @classmethod
    def of(cls, linear: nn.Linear) -> "SmallRowsLinear":
        """One holding ``linear``'s own parameters (not copies)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rows_of(x: torch.Tensor) -> int:
    """The rows of ``x`` as a linear sees them (all but its last dim flattened)."""
    return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``(W X^T)^T`` when ``x`` has a number of rows in :data:`ROWS` (the rows
    zero-padded to :func:`padded` columns)."""
    rows = rows_of(x)
    if rows not in ROWS:
        return F.linear(x, weight, bias)
    SmallRowsLinear.served += 1
    x2 = x.reshape(rows, -1)
    if (cols := padded(rows)) != rows:
        x2 = F.pad(x2, (0, 0, 0, cols - rows))
    y = fused_f32_cpu.transposed(tall_mm(weight, x2.t()), rows)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def tall_mm(weight: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
    """``torch.mm(weight, xt)``, a weight of more than ``2 * CHUNK`` rows (the tied LM head) in near-equal slabs of
    about :data:`CHUNK` rows (a multiple of 64; a last sliver would take another kernel), each its own sgemm into its
    rows of the output: the same sums, so the same bits (tested)."""
    n = weight.shape[0]
    if n <= 2 * CHUNK:
        return torch.mm(weight, xt)
    slabs = -(-n // CHUNK)
    size = 64 * -(-n // (64 * slabs))                     # ceil(n / slabs), rounded up to a multiple of 64
    out = torch.empty(n, xt.shape[1], dtype=xt.dtype, device=xt.device)
    for i in range(0, n, size):
        torch.mm(weight[i:i + size], xt, out=out[i:i + size])
    return out


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
    copies), and the model's ``head_gemm`` (if it has one) :func:`linear`, where :func:`applies`; returns how many
    linears."""
    if not applies(device, dtype):
        return 0
    count = replace_linears(model, (torch.float32,), lambda parent, name, child: SmallRowsLinear.of(child))
    if hasattr(model, "head_gemm"):   # a tied LM head is no module: its product is the model's head_gemm
        model.head_gemm = linear
    log.info("dense GEMMs: %d float32 linears and the LM head run 2-128 rows as (W X^T)^T", count)
    return count
