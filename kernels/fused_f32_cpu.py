"""Fused float32 elementwise ops on CPU, bit for bit the eager chains they replace: RMSNorm (optionally after the
residual add), RoPE on q and k, SiLU(gate) * up; and a transpose, the small-rows linears' way back from ``W X^T``
(kernels/small_rows_linear.py: torch's strided copy took ~9 of a 136 ms float32 decode step at 32 sequences).

Why: on CPUs without AVX-512 ``--dtype auto`` is float32, and a decode step's norms, RoPE and SwiGLU ran as ~16 eager
torch calls a layer, each a Python call, a dispatch and an allocation for a few hundred floats: ~16 of a one-sequence
step's ~41 ms, ~26 of 166 at 32 sequences (benchmarks/profile_step.py on a 2-core AMD EPYC, Zen 3). One op a part
does the same arithmetic in one pass.

Numerics: the same as the eager float32 chain (runtime/models/llama.py), bit for bit, not merely close: every sum is
added in the order torch's own CPU kernels add it, so the greedy engine keeps transformers' tokens exactly as before.
- RMSNorm: ``(s * r) * w`` with ``r = 1 / sqrt(sum(s * s) / N + eps)`` and ``s = res + x`` (or ``x``). The sum of
  squares follows torch's vectorized inner sum (aten/src/ATen/native/cpu/SumKernel.cpp): ``L``-lane vector partial
  sums over four interleaved accumulators, cascaded in levels of 16 vectors, then the tail and the lanes added in
  order; ``L`` = 8, the lanes of the AVX2 kernels torch picks on a CPU without AVX-512.
- RoPE: ``x * cos + rotate_half(x) * sin``, each product and the sum rounded as the three eager ops round them (built
  with ``-ffp-contract=off``: no fused multiply-add).
- SiLU: ``g / (1 + e^-g)`` with SLEEF's ``expf`` (1-ulp), the function torch's vectorized SiLU calls, linked from
  torch's own library; then ``* up``.
tests/kernels/test_fused_f32_cpu.py compares each op with the eager chain with ``torch.equal``.

Served for float32 tensors on CPU where torch runs its AVX2 kernels (``torch.backends.cpu.get_cpu_capability()``: CPUs
without AVX-512, where ``--dtype auto`` is float32) and this builds. Torch's AVX-512 kernels sum in 16 lanes; that
order is not replicated (no CPU here to check it on), so there, on a build failure or with
``PDSERVE_CPU_FUSED_ELEMENTWISE=0``, the eager chains run.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sleef.h>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {
constexpr int64_t L = 8;

// sum(s[i] * s[i]) over n floats, added in torch's order for a contiguous inner reduction: vector i of the row goes
// to accumulator i % 4; runs of 16 such quads cascade into up to 4 levels; then leftovers, levels, accumulators;
// then the scalar tail and the lanes one by one.
float sum_squares(const float* s, int64_t n) {
  const int64_t nv = n / L, rows = nv / 4;
  int64_t power = 0;
  while ((int64_t(1) << power) < rows) power++;   // ceil(log2(rows))
  power = std::max<int64_t>(4, power / 4);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  __m256 acc[4][4];
  for (auto& lv : acc) for (auto& a : lv) a = _mm256_setzero_ps();
  auto sq = [&](int64_t v) { const __m256 x = _mm256_loadu_ps(s + v * L); return _mm256_mul_ps(x, x); };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq(4 * i + k));
    for (int j = 1; j < 4; j++) {
      for (int k = 0; k < 4; k++) { acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]); acc[j - 1][k] = _mm256_setzero_ps(); }
      if (i & (mask << (j * power))) break;
    }
  }
  for (; i < rows; i++)
    for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], sq(4 * i + k));
  for (int j = 1; j < 4; j++)
    for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = rows * 4; v < nv; v++) acc[0][0] = _mm256_add_ps(acc[0][0], sq(v));
  for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  alignas(64) float lanes[L];
  _mm256_storeu_ps(lanes, acc[0][0]);
  float total = 0.f;
  for (int64_t t = nv * L; t < n; t++) total += s[t] * s[t];
  for (int64_t k = 0; k < L; k++) total += lanes[k];
  return total;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, what, ": float32 (T, N) with unit stride");
}

// -> (out, sum): out = (s * r) * w, r = 1 / sqrt(sum(s^2) / N + eps) over each row of s, where s = x, or with res,
// s = res + x (the new residual stream, returned as sum; x itself without res).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                            const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == N && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight: contiguous float32 (N,)");
  at::Tensor sum = x;
  if (res) {
    check_rows(*res, "residual");
    TORCH_CHECK(res->sizes() == x.sizes(), "residual: x's shape");
    sum = at::empty({T, N}, x.options());
  }
  at::Tensor out = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = res ? res->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = res ? res->stride(0) : 0;
  const float feps = float(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* s = xp + t * xs;
      if (rp) {
        float* sr = sp + t * N;
        for (int64_t i = 0; i < N; i++) sr[i] = rp[t * rs + i] + s[i];
        s = sr;
      }
      const float r = 1.f / std::sqrt(sum_squares(s, N) / float(N) + feps);
      float* o = op + t * N;
      for (int64_t i = 0; i < N; i++) o[i] = (s[i] * r) * wp[i];
    }
  });
  return {out, sum};
}

// qk (T, Hq, D) rows of stride s0 (a view into the fused qkv output), cos/sin (T, 1, D) float32 -> (T, Hq, D):
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2])
at::Tensor rope(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kFloat && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk: float32 (T, H, D), heads contiguous");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), h = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim: even");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->dim() == 3 && c->size(0) == T && c->size(1) == 1 && c->size(2) == D &&
                c->scalar_type() == at::kFloat && c->stride(2) == 1, "cos/sin: float32 (T, 1, D)");
  at::Tensor out = at::empty({T, H, D}, qk.options());
  const float* xp = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = qk.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t hd = 0; hd < H; hd++) {
        const float* x = xp + t * xs + hd * D;
        float* o = op + (t * H + hd) * D;
        for (int64_t i = 0; i < h; i++) {
          o[i] = x[i] * c[i] + (-x[h + i]) * s[i];
          o[h + i] = x[h + i] * c[h + i] + x[i] * s[h + i];
        }
      }
    }
  });
  return out;
}

// gate_up (T, 2I) -> (T, I): silu(gate) * up, silu(g) = g / (1 + e^-g): SLEEF's expf on the pairs of whole vectors
// torch's vector loop takes, the C library's expf on the rest of a row (its scalar tail)
at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, vec_end = I / (2 * L) * (2 * L);
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up: an even width");
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const float* g = gp + t * gs;
      float* o = op + t * I;
      for (int64_t i = 0; i < vec_end; i += L) {
        const __m256 x = _mm256_loadu_ps(g + i), e = Sleef_expf8_u10(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)));   // e^-x
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                              _mm256_loadu_ps(g + I + i)));
      }
      for (int64_t i = vec_end; i < I; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
  });
  return out;
}

// The 8 x 8 floats of r, transposed in registers
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) {
      u[4 * i + 2 * j] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + j + 2], 0x44);
      u[4 * i + 2 * j + 1] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + j + 2], 0xee);
    }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// r (N, C) -> the transpose of its first T columns (T, N), contiguous (what r[:, :T].t().contiguous() copies): 8 x 8
// tiles through registers, the 8-row strips of r spread over the threads
at::Tensor transpose(const at::Tensor& r, int64_t T) {
  TORCH_CHECK(r.dim() == 2 && r.scalar_type() == at::kFloat && r.is_contiguous(), "r: contiguous float32 (N, C)");
  TORCH_CHECK(T >= 0 && T <= r.size(1), "cols: between 0 and r's columns");
  const int64_t N = r.size(0), C = r.size(1), T8 = T / 8 * 8;
  at::Tensor y = at::empty({T, N}, r.options());
  const float* s = r.data_ptr<float>();
  float* d = y.data_ptr<float>();
  at::parallel_for(0, (N + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t n = 8 * b0; n < std::min(N, 8 * b1); n += 8) {
      if (n + 8 > N) {
        for (int64_t i = n; i < N; i++)
          for (int64_t t = 0; t < T; t++) d[t * N + i] = s[i * C + t];
        continue;
      }
      for (int64_t t = 0; t < T8; t += 8) {
        __m256 x[8];
        for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_ps(s + (n + i) * C + t);
        transpose8(x);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(d + (t + j) * N + n, x[j]);
      }
      for (int64_t t = T8; t < T; t++)
        for (int i = 0; i < 8; i++) d[t * N + n + i] = s[(n + i) * C + t];
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(pdserve_fused_f32_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? res, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor qk, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("transpose(Tensor r, int cols) -> Tensor");
  m.impl("transpose", c10::DispatchKey::CPU, TORCH_FN(transpose));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the ops; None when they work here, else why they cannot be used."""
    if (capability := torch.backends.cpu.get_cpu_capability()) != "AVX2":   # its 8-lane summation order
        return f"the fused float32 ops follow torch's AVX2 kernels; torch runs {capability}"
    reason = cpp_build.build("pdserve_fused_f32_cpu", SOURCE, ["-O3", "-fopenmp", "-ffp-contract=off", "-mavx2"],
                             "the fused float32 CPU elementwise ops")
    if reason:
        log.warning("%s; float32 RMSNorm, RoPE and SiLU run eager torch ops", reason)
    return reason


def enabled(x: torch.Tensor) -> bool:
    """Whether the ops serve ``x``: float32 on CPU, built here, not switched off (``PDSERVE_CPU_FUSED_ELEMENTWISE``)."""
    from pdserve.runtime import envs

    return (x.device.type == "cpu" and x.dtype == torch.float32 and envs.cpu_fused_elementwise()
            and load_extension() is None)


def transposed(r: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """``r[:, :cols].t().contiguous()`` (all columns by default) for a contiguous 2-D ``r``: the ``transpose`` op's
    8 x 8 register tiles where the ops serve (the same values, ~3x faster than torch's strided copy), else torch's
    copy."""
    cols = r.shape[1] if cols is None else cols
    return torch.ops.pdserve_fused_f32_cpu.transpose(r, cols) if enabled(r) else r[:, :cols].t().contiguous()
