"""Fused bf16 elementwise ops on CPU: RMSNorm (optionally after a residual add), RoPE on q and k, SiLU(gate) * up;
and the greedy sampler's row argmax over float32 logits (torch.argmax's answer, ~10x faster than torch's here).

Each replaces a chain of eager torch ops that reads and writes the whole activation once per op (RMSNorm: float copy,
square, mean, scale, cast, weight: six passes; RoPE: four products and sums plus the ``rotate_half`` copy) with one
pass per row, spread over torch's threads. The results are those of the eager chain bit for bit except where it sums:
every intermediate the eager bf16 code rounds to bf16 is rounded here at the same point (round to nearest even), so a
bf16 engine keeps the numerics it had (tests/kernels/test_fused_cpu.py compares both on the same inputs). SiLU uses
its own vectorized exp (~2e-7 relative), where torch uses Sleef's.

Only for bf16 tensors on a CPU with AVX512-BF16 (the same build as kernels/paged_prefill_cpu.py's gate); float32 has
its own ops, bit for bit the eager chain (kernels/fused_f32_cpu.py; :func:`ops_for` picks).
``PDSERVE_CPU_FUSED_ELEMENTWISE=0`` turns both off.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build, fused_f32_cpu
from pdserve.kernels.cpu_simd import AVX512_HELPERS

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <tuple>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PD_AVX512 1
#endif

namespace {
#ifdef PD_AVX512
""" + AVX512_HELPERS + r"""

// f32 -> bf16, round to nearest even (as torch's casts)
inline __m256i bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline void store16(uint16_t* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, bf16(x)); }

// silu(g) = g / (1 + e^-g), as torch computes it (a true division: a reciprocal estimate, even refined, changed the
// bf16 result on ~0.1% of elements), from t = e^-|g| in exp16's range: g / (1 + t) for g >= 0, g t / (1 + t) below.
// One division where e^-g for g < 0 (as 1 / e^g) took a second one: 24 rows of the default model 18.8 -> 13.4 us.
inline __m512 silu16(__m512 g) {
  const __m512 t = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_min_ps(_mm512_abs_ps(g), _mm512_set1_ps(88.f))));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_div_ps(_mm512_mask_mul_ps(g, neg, g, t), _mm512_add_ps(_mm512_set1_ps(1.f), t));
}
#endif

bool available() {
#ifdef PD_AVX512
  return true;
#else
  return false;
#endif
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kBFloat16 && t.stride(1) == 1, what, ": bf16 (T, N) with unit stride");
}

// -> (out, sum): out = bf16(bf16(s * r) * w), r = 1 / sqrt(mean(s^2) + eps) over each row of s, where s = x, or with
// res, s = bf16(res + x) (the new residual stream, returned as sum; x itself without res).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& res,
                                            const at::Tensor& w, double eps) {
  TORCH_CHECK(available(), "fused CPU ops need AVX512-BF16");
  check_rows(x, "x");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(N % 16 == 0 && w.dim() == 1 && w.size(0) == N && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "weight: contiguous bf16 (N,), N a multiple of 16");
  const uint16_t* rp = nullptr;
  int64_t rs = 0;
  at::Tensor sum = x;
  if (res) {
    check_rows(*res, "residual");
    TORCH_CHECK(res->sizes() == x.sizes(), "residual: x's shape");
    rp = (const uint16_t*)res->data_ptr(); rs = res->stride(0);
    sum = at::empty({T, N}, x.options());
  }
  uint16_t* sp = (uint16_t*)sum.data_ptr();
  at::Tensor out = at::empty({T, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* wp = (const uint16_t*)w.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t xs = x.stride(0);
#ifdef PD_AVX512
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const uint16_t* xr = xp + t * xs;
      if (rp) {  // residual + x, rounded as eager bf16 addition does; it becomes the row's input
        uint16_t* sr = sp + t * N;
        for (int64_t i = 0; i < N; i += 16) store16(sr + i, _mm512_add_ps(load16(rp + t * rs + i), load16(xr + i)));
        xr = sr;
      }
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < N; i += 16) { const __m512 v = load16(xr + i); ss = _mm512_fmadd_ps(v, v, ss); }
      const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / float(N) + float(eps)));
      for (int64_t i = 0; i < N; i += 16)
        store16(op + t * N + i, _mm512_mul_ps(round16(_mm512_mul_ps(load16(xr + i), r)), load16(wp + i)));
    }
  });
#endif
  return {out, sum};
}

// qk (T, Hq, D) rows of stride s0 (a view into the fused qkv output), cos/sin (T, 1, D) bf16 -> (T, Hq, D):
// bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x[D/2:], x[:D/2])
at::Tensor rope(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(available(), "fused CPU ops need AVX512-BF16");
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kBFloat16 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk: bf16 (T, H, D), heads contiguous");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), h = D / 2;
  TORCH_CHECK(D % 32 == 0, "head_dim: a multiple of 32");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->dim() == 3 && c->size(0) == T && c->size(1) == 1 && c->size(2) == D &&
                c->scalar_type() == at::kBFloat16 && c->stride(2) == 1, "cos/sin: bf16 (T, 1, D)");
  at::Tensor out = at::empty({T, H, D}, qk.options());
  const uint16_t* xp = (const uint16_t*)qk.data_ptr();
  const uint16_t* cp = (const uint16_t*)cos.data_ptr();
  const uint16_t* sp = (const uint16_t*)sin.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t xs = qk.stride(0), cs = cos.stride(0), ss = sin.stride(0);
#ifdef PD_AVX512
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      for (int64_t hd = 0; hd < H; hd++) {
        const uint16_t* x = xp + t * xs + hd * D;
        uint16_t* o = op + (t * H + hd) * D;
        for (int64_t i = 0; i < h; i += 16) {
          const __m512 lo = load16(x + i), hi = load16(x + h + i);
          const __m512 nhi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
          store16(o + i, _mm512_add_ps(round16(_mm512_mul_ps(lo, load16(cp + t * cs + i))),
                                       round16(_mm512_mul_ps(nhi, load16(sp + t * ss + i)))));
          store16(o + h + i, _mm512_add_ps(round16(_mm512_mul_ps(hi, load16(cp + t * cs + h + i))),
                                           round16(_mm512_mul_ps(lo, load16(sp + t * ss + h + i)))));
        }
      }
  });
#endif
  return out;
}

// gate_up (T, 2I) -> (T, I): bf16(bf16(silu(gate)) * up)
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(available(), "fused CPU ops need AVX512-BF16");
  check_rows(gu, "gate_up");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 32 == 0, "gate_up: width a multiple of 32");
  at::Tensor out = at::empty({T, I}, gu.options());
  const uint16_t* gp = (const uint16_t*)gu.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t gs = gu.stride(0);
#ifdef PD_AVX512
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = load16(gp + t * gs + i), u = load16(gp + t * gs + I + i);
        store16(op + t * I + i, _mm512_mul_ps(round16(silu16(g)), u));
      }
  });
#endif
  return out;
}

// x (N, V) float32 rows -> (N,) int64, torch.argmax's answer: the first maximum, or the first NaN of a row with one.
// One vector pass for the max (and any NaN), then a scan to its first position; rows spread over the threads.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(available(), "fused CPU ops need AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 && x.stride(1) == 1,
              "x: float32 (N, V) with unit-stride rows, V >= 1");
  const int64_t N = x.size(0), V = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
#ifdef PD_AVX512
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* row = xp + r * xs;
      __m512 m = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int64_t i = 0; i < V; i += 16) {
        const __mmask16 k = V - i >= 16 ? 0xffff : (__mmask16)((1u << (V - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, row + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
      }
      int64_t i = 0;
      if (nan) {
        while (!std::isnan(row[i])) i++;
      } else {
        const float best = _mm512_reduce_max_ps(m);
        const __m512 b = _mm512_set1_ps(best);
        while (i + 16 <= V && !_mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), b, _CMP_EQ_OQ)) i += 16;
        while (row[i] != best) i++;
      }
      op[r] = i;
    }
  });
#endif
  return out;
}
}  // namespace

TORCH_LIBRARY(pdserve_fused_cpu, m) {
  m.def("available() -> bool", &available);
  m.def("rms_norm(Tensor x, Tensor? res, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor qk, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(rope));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("argmax", c10::DispatchKey::CPU, TORCH_FN(argmax));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the ops; None when they work here, else why they cannot be used."""
    reason = cpp_build.build_for("pdserve_fused_cpu", SOURCE, ("avx512_bf16",), "the fused CPU elementwise ops")
    if reason:
        log.warning("%s; bf16 RMSNorm, RoPE and SiLU run eager torch ops", reason)
    return reason


def enabled(x: torch.Tensor, multiple: int = 16) -> bool:
    """Whether the fused ops serve ``x``: bf16 on CPU, last dim a ``multiple`` of the op's vector width (16 for
    RMSNorm, 32 for RoPE's half-head and SiLU's two halves), built, not switched off."""
    from pdserve.runtime import envs

    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] % multiple == 0
            and envs.cpu_fused_elementwise() and load_extension() is None)


def ops_for(x: torch.Tensor, multiple: int = 16):
    """The namespace of fused ops serving ``x`` (``rms_norm``, ``rope``, ``silu_mul``): these for bf16 (see
    :func:`enabled`), kernels/fused_f32_cpu.py's for float32; None: the eager chains run."""
    if enabled(x, multiple):
        return torch.ops.pdserve_fused_cpu
    return torch.ops.pdserve_fused_f32_cpu if fused_f32_cpu.enabled(x) else None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of float32 (N, V) rows on CPU, by the op above where it is built (torch's CPU argmax
    reads 32 x 49,152 logits at ~2.5 ms, its max at ~0.2: the greedy sampler's whole cost); torch's elsewhere."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 \
            and load_extension() is None:
        return torch.ops.pdserve_fused_cpu.argmax(x)
    return x.argmax(dim=-1)
