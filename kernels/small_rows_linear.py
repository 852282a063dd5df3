"""Float32 dense linears of 1-256 rows on CPUs without AVX-512: pdserve's own AVX2 kernel, or where it cannot be
built ``y = (W X^T)^T`` instead of ``X W^T`` at 2-128.

Why: a decode step of 1-256 sequences (or a short prefill) multiplies that many rows by every weight. torch's
``F.linear`` (MKL's sgemm) at those shapes runs well below the CPU's speed on a 2-core AMD EPYC (Zen 3, AVX2); the
same sgemm with the operands' roles swapped (the weight as the left-hand matrix, the few rows as the right-hand
columns) does not. The default model's 120 decoder linears, 2 threads: ``F.linear`` 50 ms at 2-4 rows, 54 at 16, 95
at 32, 143 at 64, 238 at 128; swapped 21-22, 45, 65, 106, 193. At one row the two run alike; from ~160 rows on (a
prefill) ``F.linear`` is as fast or faster (benchmarks/RESULTS.md). The tied LM head (49,152 x 576) gains the same
way at 2-32 rows (18-20 ms -> 5-16 ms at 4-16); the model calls its ``head_gemm``, which :func:`swap_linears` points
here.

The swapped sgemm still runs at ~110 GFLOP/s at 32 rows, where MKL reaches ~175 on large products, and far slower
at row counts off a multiple of 16 (31 rows: 125 ms vs 62 at 32). The kernel here (:data:`SOURCE`) serves instead:
the rows packed k-major in slabs of 16 (zeros past the last), the weight walked in tiles of 6 rows that each stay in
cache while every slab passes, 6 x 16 outputs in 12 AVX2 registers, the next tile prefetched meanwhile (the weight
streams from memory, and without it a tile's first slab waits on it). Decoder linears at 1 / 8 / 16 / 32 / 64 rows:
21 / 22 / 22 / 42 / 83 ms vs 29 (``F.linear``) / 40 / 42 / 60 / 96 for the sgemm at the padding below; the LM head
at 32 rows 10 vs 16 ms. At 136-256 rows (a short prompt's step) it beats ``F.linear`` by 5-15% (cold weights,
interleaved runs), and from ~300 rows the two are even. Where the kernel cannot be built the sgemm serves 2-128
rows, zero-padded.

Numerics: the sgemm paths are MKL's float32 sgemm over the same K; where this module does not serve the outputs are
bit-equal, where it does they differ by float32 rounding (~5e-7 of the output), as batched rows already differ from
a single row's GEMV. The kernel adds each output's products in k order, in FMA chains of 128 whose sums are added in
order: within a float32 sum's rounding of the exact product (tested against float64), and a row's bits depend on that
row alone, not on the rows batched with it nor on the threads. Greedy float32 output keeps transformers' tokens (the
engine parity tests run on it where it applies).

Only where measured: float32 on CPUs without AVX-512 (there bf16 is emulated and ``--dtype auto`` picks float32); an
AVX-512 host runs bf16 by default, with its own kernels. ``PDSERVE_CPU_SMALL_ROWS_GEMM=0`` keeps ``F.linear``.
``SmallRowsLinear.served`` counts the calls it served.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpp_build, fused_f32_cpu
from pdserve.kernels.packed_linear import replace_linears

log = logging.getLogger(__name__)

ROWS = range(1, 257)         # the row counts served on the kernel; elsewhere F.linear
SGEMM_ROWS = range(2, 129)   # where the kernel cannot serve: the swapped sgemm's; elsewhere F.linear
# Rows of a tall weight per sgemm call: MKL runs the tied LM head (49,152 x 576) faster in slabs than whole, at 16-32
# rows 13.8 -> 10.9 and 18.8 -> 15.8 ms (2 threads, Zen 3); the decoder's linears gain nothing (benchmarks/RESULTS.md).
CHUNK = 3072
# Where the kernel cannot be built, above PAD_ABOVE rows the sgemm runs the rows zero-padded to a multiple of PAD_TO:
# MKL runs W X^T at a multiple of 16 columns far faster than at the columns around it (the default model's decoder
# linears, 2 threads, Zen 3: 11-15 rows 58-91 ms vs 43 at 16; 31 rows 125 vs 62 at 32; 47: 136 vs 81 at 48), and
# never much slower (benchmarks/RESULTS.md). The padding's outputs are dropped by the transpose back.
PAD_ABOVE, PAD_TO = 8, 16


def padded(rows: int) -> int:
    """The columns the sgemm runs ``rows`` rows at: above :data:`PAD_ABOVE`, the next multiple of :data:`PAD_TO`."""
    return rows if rows <= PAD_ABOVE else -(-rows // PAD_TO) * PAD_TO


SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {
constexpr int64_t MR = 6, KC = 128;   // weight rows per tile; k per partial sum

// out[j][i] (row stride N) = sum_k w[i][k] * xs[k][j] for M weight rows (row stride K) and a slab of 16 columns of
// x, packed k-major (xs[k][j]); only the slab's first `cols` columns are written. Each sum: KC-long FMA chains from
// zero, added in k order: a column's bits depend on its own row of x alone, whatever else the slab holds. Meanwhile
// rows [p0, p1) of the next tile (`next`, row stride K) are prefetched into L2, a cache line of each per 16 k: the
// weight comes from memory, and a tile's first slab would otherwise wait on it.
template <int M>
void tile(const float* w, int64_t K, const float* xs, float* out, int64_t N, int64_t cols, const float* next, int p0,
          int p1) {
  alignas(32) float tot[M][16];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    __m256 acc[M][2];
    for (auto& r : acc) r[0] = r[1] = _mm256_setzero_ps();
    for (int64_t k = k0, k1 = std::min(K, k0 + KC); k < k1; k++) {
      const __m256 b0 = _mm256_load_ps(xs + k * 16), b1 = _mm256_load_ps(xs + k * 16 + 8);
      if ((k & 15) == 0)
        for (int i = p0; i < p1; i++) _mm_prefetch(reinterpret_cast<const char*>(next + i * K + k), _MM_HINT_T1);
      for (int i = 0; i < M; i++) {
        const __m256 a = _mm256_broadcast_ss(w + i * K + k);
        acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
      }
    }
    for (int i = 0; i < M; i++)
      for (int v = 0; v < 2; v++)
        _mm256_store_ps(tot[i] + 8 * v, k0 ? _mm256_add_ps(_mm256_load_ps(tot[i] + 8 * v), acc[i][v]) : acc[i][v]);
  }
  for (int64_t j = 0; j < cols; j++)
    for (int i = 0; i < M; i++) out[j * N + i] = tot[i][j];
}

void tiles(int64_t m, const float* w, int64_t K, const float* xs, float* out, int64_t N, int64_t cols,
           const float* next, int p0, int p1) {
  switch (m) {
    case 6: return tile<6>(w, K, xs, out, N, cols, next, p0, p1);
    case 5: return tile<5>(w, K, xs, out, N, cols, next, p0, p1);
    case 4: return tile<4>(w, K, xs, out, N, cols, next, p0, p1);
    case 3: return tile<3>(w, K, xs, out, N, cols, next, p0, p1);
    case 2: return tile<2>(w, K, xs, out, N, cols, next, p0, p1);
    default: return tile<1>(w, K, xs, out, N, cols, next, p0, p1);
  }
}

// x (T, K) @ w (N, K)^T -> (T, N), what F.linear(x, w) computes: x packed into k-major slabs of 16 of its rows (zeros
// past T), the weight's rows in tiles of 6 spread over the threads, each tile read once from memory for all slabs;
// the slabs' passes over a tile prefetch the thread's next tile, its rows shared out among them.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              w.is_contiguous() && x.size(1) == w.size(1), "x (T, K), w (N, K): float32, w contiguous");
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0), S = (T + 15) / 16;
  if (K == 0) return at::zeros({T, N}, x.options());   // empty sums (a tile's partial sums start at its first k)
  at::Tensor xp = at::zeros({S * K * 16 + 8}, x.options());   // 8 floats to align the slabs to 32 bytes
  float* packed = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xp.data_ptr<float>()) + 31) & ~uintptr_t(31));
  const auto xa = x.accessor<float, 2>();
  for (int64_t j = 0; j < T; j++)
    for (int64_t k = 0; k < K; k++) packed[(j / 16 * K + k) * 16 + j % 16] = xa[j][k];
  at::Tensor y = at::empty({T, N}, x.options());
  float* out = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, (N + MR - 1) / MR, 1, [&](int64_t b0, int64_t b1) {
    const int64_t end = std::min(N, b1 * MR);
    for (int64_t n = b0 * MR; n < end; n += MR) {
      const int64_t m = std::min(MR, end - n), next = std::clamp<int64_t>(end - n - MR, 0, MR);   // next tile's rows
      for (int64_t s = 0; s < S; s++)
        tiles(m, wp + n * K, K, packed + s * K * 16, out + s * 16 * N + n, N, std::min<int64_t>(16, T - 16 * s),
              next ? wp + (n + MR) * K : wp, int(next * s / S), int(next * (s + 1) / S));
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(pdserve_small_rows_f32_cpu, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the kernel; None when it works here, else why not."""
    from pdserve.runtime.cpu_features import cpu_flags

    if not {"avx2", "fma"} <= cpu_flags():
        return "the small-rows float32 kernel needs AVX2 and FMA"
    reason = cpp_build.build("pdserve_small_rows_f32_cpu", SOURCE, ["-O3", "-fopenmp", "-mavx2", "-mfma"],
                             "the small-rows float32 GEMM kernel")
    if reason:
        log.warning("%s; small-rows linears run MKL's sgemm", reason)
    return reason


class SmallRowsLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products of 1-256 rows run on :func:`linear`."""

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
    """``F.linear(x, weight, bias)``, for a number of rows in :data:`ROWS` on the kernel, or where it cannot serve
    (not built, a strided weight) at :data:`SGEMM_ROWS` as ``(W X^T)^T`` (the rows zero-padded to :func:`padded`
    columns)."""
    rows = rows_of(x)
    kernel = rows in ROWS and weight.is_contiguous() and load_extension() is None
    if not kernel and rows not in SGEMM_ROWS:
        return F.linear(x, weight, bias)
    SmallRowsLinear.served += 1
    x2 = x.reshape(rows, -1)
    if kernel:
        y = torch.ops.pdserve_small_rows_f32_cpu.linear(x2, weight)
    else:
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
    log.info("dense GEMMs: %d float32 linears and the LM head run 1-256 rows on the small-rows path", count)
    return count
