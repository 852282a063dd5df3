"""The greedy token of a bf16 AMX LM head on CPU without reading the whole head: exact, from an int8 screen.

A greedy row needs one number from the LM head: the first index of its largest bf16 logit. Reading the head costs a
step the same ~2 ms whatever the rows (SmolLM2's is 49,152 x 576 bf16, 57 MB, at the memory's speed): ~10% of a
cached-prefix prefill step and more of a one-sequence decode step. Here an int8 copy of the head (one scale per vocab
row: half the bytes) screens every logit, and only the 16-column blocks that can still hold a row's winner go through
the AMX linear (kernels/amx_linear.py, ``linear_blocks``: the blocks read in place), on the same rows, so their logits
are the full head's bits.

Why it is exact. For vocab row ``v`` (bf16 weights ``w``, int8 ``q``, scale ``s``: ``s q`` is ``w`` rounded to 255
levels) and a hidden row ``h`` of K values, the screen writes ``h`` as ``t (p1 + p2 / 256)``, two int8 digits
(``t = max |h| / 127``), takes ``q . p1`` and ``q . p2`` on AMX-INT8 (int32 sums: exact) and ``a = s t (q . p1 +
q . p2 / 256)``; ``f``, what the digits leave of ``h``, is computed exactly. The logit the AMX linear computes before
rounding to bf16, ``z``, then satisfies

    |z - a| <= ||h||_2 (||w - s q||_2 + 3 K 2^-24 ||w||_2) + ||s q||_2 ||f||_2 + 2^-20 |a| + 1e-6

(Cauchy-Schwarz twice; a K-term fp32 sum errs by at most K 2^-24 times the sum of its terms' sizes, <= ||w|| ||h||,
and the int32 sums' conversion to float (inexact past 2^24) by far less: 3 K covers both; 2^-20 |a| the few float ops
that form ``a`` and the bounds; 1e-6 flushed subnormals). f is ~1/256 of the one-digit error, so the second term is
small. Rounding to bf16 never reverses an order, so a block is skipped only when each of its upper bounds, rounded
to bf16, is below its row's best lower bound rounded the same way: its logits then round below the winner's, never
to the same value. Candidates are taken in vocab order, so ties keep the first index. A row whose ``||h||_2`` is not
finite screens nothing out (the full head's answer, NaN included).

``screen`` returns the union over the rows of their candidate blocks, sorted, for up to 32 rows
(``amx_linear.MAX_ROWS``: above, the head is oneDNN's and sums in another order). ``quantize`` makes the copy at
load, with the norms in float64 (~0.06 s for SmolLM2's head); the copy takes ``N * K`` bytes. On SmolLM2's
real hidden states ~9-22 blocks of 3,072 are candidates per row; in engine steps the screen and those blocks take
1.4-1.9 ms where the full head and its argmax take 2.6-3.1 ms (benchmarks/RESULTS.md, "Twelfth session").
tests/kernels/test_greedy_head_cpu.py checks the tokens against the full head, ties and bf16-rounding ties included.
"""

from __future__ import annotations

import functools

import torch

from pdserve.kernels import amx_linear, cpp_build
from pdserve.kernels.cpu_simd import AMX_HELPERS, AVX512_HELPERS

NEEDS = ("avx512vl", "avx512_bf16", "amx_tile", "amx_int8")   # the CPU flags it is built with (and needs)
# The most rows a step screens (the kernel takes 32): per row the screen bounds every logit and adds its candidate
# blocks to the exact product, and at 24-32 rows that cost what the smaller read saves (benchmarks/RESULTS.md,
# "Twelfth session").
MAX_ROWS = 16

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PD_AMX 1
#endif

namespace {
#ifdef PD_AMX
""" + AVX512_HELPERS + AMX_HELPERS + r"""

// One column block's exact integer dot products with NT row tiles of two int8 digits each: acc (NT x 2 x 16 x 16
// int32: row tile, digit, row, column) = p (NT * 16 x 2 x Kq, digit-major per row) . q^T, q the block's int8
// (kq, 16, 64) quads as tdpbssd takes them.
template <int NT>
void block_dot(const int8_t* p, int64_t Kq, const int8_t* q, int64_t kq, int32_t* acc) {
  _tile_zero(0); _tile_zero(1);
  if (NT > 1) { _tile_zero(2); _tile_zero(3); }
  const int64_t stride = 2 * Kq;   // one row: its first digits, then its second
  for (int64_t k = 0; k < kq; k++) {
    for (int i = 0; i < 16; i++)   // 4 K steps ahead (into the next block past the last: blocks are contiguous)
      _mm_prefetch((const char*)q + (k + 4) * 1024 + i * 64, _MM_HINT_T0);
    _tile_loadd(5, q + k * 1024, 64);
    _tile_loadd(4, p + k * 64, stride); _tile_dpbssd(0, 4, 5);
    _tile_loadd(4, p + Kq + k * 64, stride); _tile_dpbssd(1, 4, 5);
    if (NT > 1) {
      _tile_loadd(4, p + 16 * stride + k * 64, stride); _tile_dpbssd(2, 4, 5);
      _tile_loadd(4, p + 16 * stride + Kq + k * 64, stride); _tile_dpbssd(3, 4, 5);
    }
  }
  _tile_stored(0, acc, 64); _tile_stored(1, acc + 256, 64);
  if (NT > 1) { _tile_stored(2, acc + 512, 64); _tile_stored(3, acc + 768, 64); }
}
#endif

bool available() {
#ifdef PD_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x (M <= 32, K) bf16; q (nb, kq, 16, 64) int8 (block j, 64-wide K step k, quad row r: 16 columns x 4 K values);
// scale, err, sqn (nb * 16) float32 per vocab row: s, ||w - s q||_2 + 3 K 2^-24 ||w||_2 and ||s q||_2, the last two
// rounded up (0 past n). Returns the sorted candidate blocks.
at::Tensor screen(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& err,
                  const at::Tensor& sqn, int64_t N) {
  TORCH_CHECK(available(), "the greedy head screen needs AMX-INT8 (built with it, granted by the kernel)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1 && x.size(0) <= 32, "x: bf16 (M <= 32, K)");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == 16 && q.size(3) == 64,
              "q: int8 (nb, kq, 16, 64)");
  const int64_t M = x.size(0), K = x.size(1), nb = q.size(0), kq = q.size(1), Kq = kq * 64;
  TORCH_CHECK(kq == (K + 63) / 64 && N > (nb - 1) * 16 && N <= nb * 16, "q: the packed shape of (N, K)");
  for (const at::Tensor* t : {&scale, &err, &sqn})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == nb * 16, "scale, err, sqn: float32 (nb * 16)");
#ifdef PD_AMX
  // each row h as t (p1 + p2 / 256), two int8 digits, t = max |h| / 127; f = what is left, exactly, in float64
  const int64_t Mp = (M + 15) / 16 * 16;
  std::vector<int8_t> p(Mp * 2 * Kq, 0);
  std::vector<float> hn(M), fn(M), tm(M);   // ||h||_2, ||f||_2 (rounded up with room to spare), t
  bool all = false;                         // a row that is not finite: nothing can be screened out
  const at::Tensor xc = x.contiguous();
  const uint16_t* xs = (const uint16_t*)xc.data_ptr();
  for (int64_t m = 0; m < M; m++) {
    std::vector<double> h(K);
    double mx = 0, hh = 0, ff = 0;
    for (int64_t k = 0; k < K; k++) {
      const uint32_t u = uint32_t(xs[m * K + k]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      h[k] = f;
      mx = std::max(mx, std::fabs(h[k]));
      hh += h[k] * h[k];
    }
    const float t = mx > 0 && std::isfinite(mx) ? float(mx / 127) : 1.f;
    int8_t* p1 = p.data() + m * 2 * Kq;
    for (int64_t k = 0; k < K && std::isfinite(mx); k++) {
      const double a = std::clamp(std::nearbyint(h[k] / t), -127.0, 127.0);
      const double b = std::clamp(std::nearbyint((h[k] - a * t) / t * 256), -127.0, 127.0);
      p1[k] = int8_t(a);
      p1[Kq + k] = int8_t(b);
      const double f = h[k] - a * t - b * t / 256;
      ff += f * f;
    }
    hn[m] = float(std::sqrt(hh) * (1 + 0x1p-20));
    fn[m] = float(std::sqrt(ff) * (1 + 0x1p-20));
    tm[m] = t;
    all |= !std::isfinite(hn[m]);
  }
  const float* sc = scale.data_ptr<float>();
  const float* er = err.data_ptr<float>();
  const float* sn = sqn.data_ptr<float>();
  // row m's logits in block from v: a = s t (d1 + d2 / 256) from the int32 sums (exact in float below 2^24), and the
  // half-width ||h|| err + ||s q|| ||f|| + 2^-20 |a| + 1e-6 (2^-20 relative: room for these ops' own rounding)
  auto logit = [&](const int32_t* d1, const int32_t* d2, int64_t m, int64_t v, __m512& half) {
    const __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(d2)), _mm512_set1_ps(1.f / 256),
                                     _mm512_cvtepi32_ps(_mm512_loadu_si512(d1)));
    const __m512 a = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(tm[m])), _mm512_loadu_ps(sc + v));
    const __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(hn[m]), _mm512_loadu_ps(er + v),
                                     _mm512_mul_ps(_mm512_set1_ps(fn[m]), _mm512_loadu_ps(sn + v)));
    half = _mm512_fmadd_ps(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-20f),
                           _mm512_fmadd_ps(b, _mm512_set1_ps(1 + 0x1p-20f), _mm512_set1_ps(1e-6f)));
    return a;
  };
  auto valid = [&](int64_t v) { return __mmask16(N - v >= 16 ? 0xffff : (1u << (N - v)) - 1); };
  // pass 1: per block and row the largest upper bound rounded to bf16, and each thread's best lower bound per row
  std::vector<float> top(nb * M);
  const int threads = at::get_num_threads();
  std::vector<float> best(threads * M, -INFINITY);
  at::parallel_for(0, nb, 16, [&](int64_t j0, int64_t j1) {
    Tiles amx;
    alignas(64) int32_t acc[4 * 256];
    float* mine = best.data() + at::get_thread_num() * M;
    for (int64_t j = j0; j < j1; j++) {
      if (Mp > 16) block_dot<2>(p.data(), Kq, q.data_ptr<int8_t>() + j * kq * 1024, kq, acc);
      else block_dot<1>(p.data(), Kq, q.data_ptr<int8_t>() + j * kq * 1024, kq, acc);
      const int64_t v = j * 16;
      for (int64_t m = 0; m < M; m++) {
        const int32_t* d = acc + (m / 16) * 512 + (m % 16) * 16;   // its first-digit sums; the second 256 on
        __m512 half;
        const __m512 a = logit(d, d + 256, m, v, half);
        mine[m] = std::max(mine[m], _mm512_mask_reduce_max_ps(valid(v), _mm512_sub_ps(a, half)));
        top[j * M + m] = _mm512_mask_reduce_max_ps(valid(v), round16(_mm512_add_ps(a, half)));
      }
    }
  });
  // pass 2: a block is kept when its largest rounded upper bound reaches its row's best lower bound rounded the same
  // way (rounding keeps order: the same as any one of its upper bounds reaching it)
  std::vector<uint8_t> keep(nb, all);
  for (int64_t m = 0; m < M && !all; m++) {
    float b = -INFINITY;
    for (int t = 0; t < threads; t++) b = std::max(b, best[t * M + m]);
    const float floor = _mm512_cvtss_f32(round16(_mm512_set1_ps(b)));
    for (int64_t j = 0; j < nb; j++) keep[j] |= top[j * M + m] >= floor;
  }
  std::vector<int64_t> blocks;
  for (int64_t j = 0; j < nb; j++) if (keep[j]) blocks.push_back(j);
  return at::tensor(blocks, at::kLong);
#else
  TORCH_CHECK(false, "built without AMX");
#endif
}

// The int8 copy of w (N, K) bf16, a row at a time in float64: s = float(max |w| / 127) (1 for a zero row), q =
// clamp(round(w / s), -127, 127) into rows 0 .. N of q (rows, cols) int8 (zero elsewhere), and per row s,
// ||w - s q||_2 + 3 K 2^-24 ||w||_2 and ||s q||_2 (s q is exact in float64: an int8 times a float).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& w, int64_t rows, int64_t cols) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && rows >= w.size(0) &&
              cols >= w.size(1), "w: contiguous bf16 (N <= rows, K <= cols)");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor q = at::zeros({rows, cols}, w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({N}, w.options().dtype(at::kDouble)), err = at::empty_like(scale), sqn = at::empty_like(scale);
  const uint16_t* wp = (const uint16_t*)w.data_ptr();
  int8_t* qp = q.data_ptr<int8_t>();
  double *sp = scale.data_ptr<double>(), *ep = err.data_ptr<double>(), *np = sqn.data_ptr<double>();
  auto value = [](uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return double(f); };
  at::parallel_for(0, N, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const uint16_t* row = wp + r * K;
      double amax = 0;
      for (int64_t k = 0; k < K; k++) amax = std::max(amax, std::fabs(value(row[k])));
      double s = double(float(amax / 127));
      if (!(s > 0)) s = 1;
      double e2 = 0, w2 = 0, q2 = 0;
      for (int64_t k = 0; k < K; k++) {
        const double x = value(row[k]), v = std::clamp(std::nearbyint(x / s), -127.0, 127.0), sq = v * s;
        qp[r * cols + k] = int8_t(v);
        e2 += (x - sq) * (x - sq); w2 += x * x; q2 += sq * sq;
      }
      sp[r] = s;
      ep[r] = std::sqrt(e2) + 3 * K * std::ldexp(1.0, -24) * std::sqrt(w2);
      np[r] = std::sqrt(q2);
    }
  });
  return {q, scale, err, sqn};
}
}  // namespace

TORCH_LIBRARY(pdserve_greedy_head_cpu, m) {
  m.def("available() -> bool", &available);
  m.def("screen(Tensor x, Tensor q, Tensor scale, Tensor err, Tensor sqn, int n) -> Tensor");
  m.def("quantize(Tensor w, int rows, int cols) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("screen", c10::DispatchKey::CPU, TORCH_FN(screen));
  m.impl("quantize", c10::DispatchKey::CPU, TORCH_FN(quantize));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the screen, after the AMX linear it needs; None when both work here,
    else why not."""
    return amx_linear.load_extension() or cpp_build.build_for("pdserve_greedy_head_cpu", SOURCE, NEEDS,
                                                              "the greedy LM head screen")


def for_model(model: torch.nn.Module) -> GreedyHead | None:
    """A :class:`GreedyHead` for ``model``'s LM head where it applies (an AMX head in plain tiles without bias, no
    quantized head, the screen built here and not switched off), else None."""
    from pdserve.runtime import envs

    head = getattr(model, "lm_head", None)
    if (type(head) is not amx_linear.AmxLinear or head.packed is None or head.bias is not None
            or getattr(model, "quant_head", None) is not None
            or not envs.cpu_greedy_head() or load_extension() is not None):
        return None
    return GreedyHead(head)


def _padded(x: torch.Tensor, pad: int) -> torch.Tensor:
    """float64 (N,) -> float32 (N + pad,), each value rounded up (zeros after)."""
    f = x.float()
    f = torch.where(f.double() < x, torch.nextafter(f, torch.tensor(float("inf"))), f)
    return torch.cat([f, torch.zeros(pad)]).contiguous()


class GreedyHead:
    """The greedy tokens of an :class:`~pdserve.kernels.amx_linear.AmxLinear` LM head (no bias), exactly those of
    ``head(hidden).float().argmax(-1)``; ``screened`` counts the rows served and ``blocks`` the column blocks they
    computed exactly."""

    def __init__(self, head: amx_linear.AmxLinear) -> None:
        n, k = head.out_features, head.in_features
        p = head.packed                                                          # (N/16, K/32, 16, 32): see amx_linear.pack
        w = p.view(p.shape[0], p.shape[1], 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(p.shape[0] * 16, -1)[:n, :k]
        q8, scale, err, sqn = torch.ops.pdserve_greedy_head_cpu.quantize(w.contiguous(), p.shape[0] * 16,
                                                                         -(-k // 64) * 64)
        pad = -n % 16
        self.head = head
        self.scale, self.err, self.sqn = (_padded(x, pad) for x in (scale, err, sqn))
        # (N, K) -> (N/16, K/64, 16, 64): block j, K step kk, quad row r holds column n's q[n][64 kk + 4 r .. + 4]
        nb, kq = q8.shape[0] // 16, q8.shape[1] // 64
        self.q = q8.view(nb, 16, kq, 16, 4).permute(0, 2, 3, 1, 4).contiguous().view(nb, kq, 16, 64)
        self.screened = 0
        self.blocks = 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M,) int64 greedy tokens of ``hidden`` (M, K) bf16, M <= ``amx_linear.MAX_ROWS``."""
        rows = hidden.contiguous()
        blocks = torch.ops.pdserve_greedy_head_cpu.screen(rows, self.q, self.scale, self.err, self.sqn,
                                                           self.head.out_features)
        logits = torch.ops.pdserve_amx_linear.linear_blocks(rows, self.head.packed, blocks).float()   # read in place
        vocab = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
        logits[:, vocab >= self.head.out_features] = float("-inf")          # a last block's padding columns
        self.screened += rows.shape[0]
        self.blocks += blocks.numel()
        return vocab[logits.argmax(dim=-1)]
