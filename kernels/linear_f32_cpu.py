"""Float32 quantized linear on CPU: a fused dequantize-GEMM torch C++ extension, float32 in, float32 out.

``y = x @ w.T`` for ``w[n, k] = scale[n, g] * q[n, k] + zero[n, g]`` (``g = k // group_size``), computed per group as

    y[m, n] = sum_g scale[n, g] * (x[m, g-block] . q[n, g-block]) + zero[n, g] * sum(x[m, g-block])

in float32 with float32 scales and zeros: the codes are converted to float in registers (exact), nothing is rounded
to bfloat16 (what keeps torch's int4/int8 CPU kernels at ~73% free-running greedy agreement, runtime/quantization.py).
Not exact by construction: the products are summed in another order (and factored per group) than the dense GEMM
on the dequantized weight, so outputs differ from ``F.linear(x, w_deq)`` by float32 rounding (~1e-6 of the output).
``dequant`` (``PDSERVE_LINEAR_METHOD=dequant``) stays the exact-by-construction method.

Weights it takes: 4-bit codes, signed ([-8, 7]) or unsigned ([0, 15]), group size a multiple of 32 (GGUF Q4_0/Q4_1,
``--quantization int4``, compressed-tensors W4A16, per-channel), packed two a byte (byte ``j`` of each 32-code block
holds codes ``j`` and ``j + 16``); 8-bit codes, signed or unsigned, group size a multiple of 16 (per-channel int8,
compressed-tensors INT8, GGUF Q8_0), kept as the loader's own (N, K) tensor so that a tied LM head shares the Q8_0
embedding's codes and scales. ``in_features`` must be a multiple of 32 (4-bit) or 16 (8-bit); anything else falls to
``dequant``.

Build: compiled on first use with ``torch.utils.cpp_extension.load`` (gcc + ninja) into
``$PDSERVE_CACHE_DIR/torch_extensions/<name>``, the name keyed by a hash of the source, the torch version, the compiler
flags and the CPU's flags, so a stale or foreign build is never loaded; later processes only load it. Work is split
over output rows with ``at::parallel_for`` (torch's own thread pool). AVX-512 (F + BW) intrinsics where the CPU has
them; else AVX2 + FMA intrinsics where it has those (AMD Zen 2/3: the same per-lane sums as the AVX-512 path, in two
8-lane halves; the default model's 120 decoder linears as Q4_1 codes, 2 threads: 51.6 -> 8.2 ms at one row against
the compiler-vectorized loop, 3.4x a dense float32 ``F.linear`` there, 1.2x at 8 rows, slower from 16); a portable C++
loop elsewhere (``isa()`` says which). If the build fails (no compiler, no headers) the method logs one line and declines
every weight, so the registry falls back to ``dequant``: start-up never fails on it.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build
from pdserve.kernels.linear_base import (DeviceLinearMethod, KernelLinear, QuantizedWeight, QuantLinearModule,
                                         register_linear_method)

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstdint>
#include <string>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

namespace {
// activation rows per pass over a weight row: weights are read once per MB rows (AVX2: its 16 vector registers hold
// the sums of 4)
#ifdef PD_AVX2
constexpr int64_t MB = 4;
#else
constexpr int64_t MB = 8;
#endif

struct Args {
  const float* x; const uint8_t* codes; const float* scale; const float* zero; const float* xsum; float* y;
  int64_t M, N, K, G; bool is_signed;
};

// y[m0:m0+NM, n] for one weight row n. 4-bit: codes (N, K/2), byte j of a 32-block = code j | code j+16 << 4.
// 8-bit: codes (N, K) int8 or uint8. Group sums are formed in float32 then scaled (see the Python docstring).
// NM (rows of x) is a template argument so that the accumulators stay in registers (a runtime count spills them).
template <int BITS, int NM>
void row(const Args& a, int64_t n, int64_t m0) {
  const int64_t ng = a.K / a.G, K = a.K, G = a.G;
  const float* s = a.scale + n * ng;
  const float* z = a.zero ? a.zero + n * ng : nullptr;
  const uint8_t* c = a.codes + n * (BITS == 4 ? K / 2 : K);
  const float* x = a.x + m0 * K;
#ifdef PD_AVX512
  __m512 acc[NM], t[NM];
  for (int m = 0; m < NM; m++) acc[m] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(15);
  const __m512i off = _mm512_set1_epi32(a.is_signed ? 8 : 0);
  for (int64_t g = 0; g < ng; g++) {
    for (int m = 0; m < NM; m++) t[m] = _mm512_setzero_ps();
    if (BITS == 4) {
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        __m128i b = _mm_loadu_si128((const __m128i*)(c + k / 2));
        __m512 qlo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)), off));
        __m512 qhi = _mm512_cvtepi32_ps(_mm512_sub_epi32(
            _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)), off));
        for (int m = 0; m < NM; m++)
          t[m] = _mm512_fmadd_ps(qhi, _mm512_loadu_ps(x + m * K + k + 16),
                                 _mm512_fmadd_ps(qlo, _mm512_loadu_ps(x + m * K + k), t[m]));
      }
    } else {
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        __m128i b = _mm_loadu_si128((const __m128i*)(c + k));
        __m512 q = _mm512_cvtepi32_ps(a.is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
        for (int m = 0; m < NM; m++) t[m] = _mm512_fmadd_ps(q, _mm512_loadu_ps(x + m * K + k), t[m]);
      }
    }
    const __m512 sv = _mm512_set1_ps(s[g]);
    for (int m = 0; m < NM; m++) acc[m] = _mm512_fmadd_ps(t[m], sv, acc[m]);
  }
  for (int m = 0; m < NM; m++) {
    float zacc = 0.f;
    if (z) for (int64_t g = 0; g < ng; g++) zacc += z[g] * a.xsum[(m0 + m) * ng + g];
    a.y[(m0 + m) * a.N + n] = _mm512_reduce_add_ps(acc[m]) + zacc;
  }
#elif defined(PD_AVX2)  // the AVX-512 sums, each of its 16 lanes' sums in the same order: lanes 0-7 in [0], 8-15 in [1]
  __m256 acc[NM][2], t[NM][2];
  for (int m = 0; m < NM; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(15);
  const __m256i off = _mm256_set1_epi32(a.is_signed ? 8 : 0);
  const auto nibbles = [&](__m128i b) {   // the low 8 bytes' codes as floats
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), off));
  };
  const auto bytes = [&](__m128i b) {
    return _mm256_cvtepi32_ps(a.is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  };
  for (int64_t g = 0; g < ng; g++) {
    for (int m = 0; m < NM; m++) t[m][0] = t[m][1] = _mm256_setzero_ps();
    if (BITS == 4) {
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(c + k / 2));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m256 q0 = nibbles(lo), q1 = nibbles(_mm_srli_si128(lo, 8));   // codes 0-7, 8-15
        const __m256 q2 = nibbles(hi), q3 = nibbles(_mm_srli_si128(hi, 8));   // codes 16-23, 24-31
        for (int m = 0; m < NM; m++) {
          const float* xm = x + m * K + k;
          t[m][0] = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xm + 16), _mm256_fmadd_ps(q0, _mm256_loadu_ps(xm), t[m][0]));
          t[m][1] = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xm + 24), _mm256_fmadd_ps(q1, _mm256_loadu_ps(xm + 8), t[m][1]));
        }
      }
    } else {
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(c + k));
        const __m256 q0 = bytes(b), q1 = bytes(_mm_srli_si128(b, 8));
        for (int m = 0; m < NM; m++) {
          t[m][0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(x + m * K + k), t[m][0]);
          t[m][1] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(x + m * K + k + 8), t[m][1]);
        }
      }
    }
    const __m256 sv = _mm256_set1_ps(s[g]);
    for (int m = 0; m < NM; m++)
      for (int h = 0; h < 2; h++) acc[m][h] = _mm256_fmadd_ps(t[m][h], sv, acc[m][h]);
  }
  for (int m = 0; m < NM; m++) {
    float zacc = 0.f;
    if (z) for (int64_t g = 0; g < ng; g++) zacc += z[g] * a.xsum[(m0 + m) * ng + g];
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[m][0]), _mm256_castps256_ps128(acc[m][1]));
    r = _mm_add_ps(r, _mm_add_ps(_mm256_extractf128_ps(acc[m][0], 1), _mm256_extractf128_ps(acc[m][1], 1)));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    a.y[(m0 + m) * a.N + n] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r))) + zacc;
  }
#else  // the same sums in 16 explicit lanes (what the compiler vectorizes): the AVX-512 order
  float acc[NM][16] = {};
  const int off = a.is_signed ? 8 : 0;
  for (int64_t g = 0; g < ng; g++) {
    float t[NM][16] = {};
    if (BITS == 4) {
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        float qlo[16], qhi[16];
        for (int j = 0; j < 16; j++) {
          qlo[j] = (float)((c[k / 2 + j] & 15) - off);
          qhi[j] = (float)((c[k / 2 + j] >> 4) - off);
        }
        for (int m = 0; m < NM; m++)
          for (int j = 0; j < 16; j++) t[m][j] += qlo[j] * x[m * K + k + j] + qhi[j] * x[m * K + k + 16 + j];
      }
    } else {
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        float q[16];
        for (int j = 0; j < 16; j++) q[j] = a.is_signed ? (float)(int8_t)c[k + j] : (float)c[k + j];
        for (int m = 0; m < NM; m++)
          for (int j = 0; j < 16; j++) t[m][j] += q[j] * x[m * K + k + j];
      }
    }
    for (int m = 0; m < NM; m++)
      for (int j = 0; j < 16; j++) acc[m][j] += t[m][j] * s[g];
  }
  for (int m = 0; m < NM; m++) {
    float zacc = 0.f, sum = 0.f;
    if (z) for (int64_t g = 0; g < ng; g++) zacc += z[g] * a.xsum[(m0 + m) * ng + g];
    for (int j = 0; j < 16; j++) sum += acc[m][j];
    a.y[(m0 + m) * a.N + n] = sum + zacc;
  }
#endif
}

template <int BITS>
void rows(const Args& a, int64_t n0, int64_t n1, int64_t m0, int64_t mb) {
  switch (mb) {
#define PD_ROWS(NM) case NM: for (int64_t n = n0; n < n1; n++) row<BITS, NM>(a, n, m0); break;
    PD_ROWS(1) PD_ROWS(2) PD_ROWS(3) PD_ROWS(4) PD_ROWS(5) PD_ROWS(6) PD_ROWS(7) PD_ROWS(8)
#undef PD_ROWS
  }
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
              const std::optional<at::Tensor>& zero, int64_t bits, int64_t group_size, bool is_signed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 (M, K)");
  TORCH_CHECK(codes.is_contiguous() && codes.element_size() == 1, "codes: contiguous bytes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale: contiguous float32");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = group_size;
  TORCH_CHECK(G % (bits == 4 ? 32 : 16) == 0 && K % G == 0 && scale.size(0) == N && scale.size(1) == K / G,
              "shapes: K a multiple of the group size, the group size of 32 (4-bit) or 16 (8-bit)");
  TORCH_CHECK(codes.size(1) == (bits == 4 ? K / 2 : K), "codes: (N, K/2) for 4-bit, (N, K) for 8-bit");
  at::Tensor xsum;
  const float* zp = nullptr;
  if (zero.has_value()) {
    TORCH_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->sizes() == scale.sizes(), "zero");
    zp = zero->data_ptr<float>();
    xsum = x.view({M, K / G, G}).sum(-1).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const Args a{x.data_ptr<float>(), (const uint8_t*)codes.data_ptr(), scale.data_ptr<float>(), zp,
               zp ? xsum.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K, G, is_signed};
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      if (bits == 4) rows<4>(a, n0, n1, m0, mb); else rows<8>(a, n0, n1, m0, mb);
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(pdserve_qf32, m) {
  m.def("mm(Tensor x, Tensor codes, Tensor scale, Tensor? zero, int bits, int group_size, bool is_signed) -> Tensor");
  m.impl("mm", c10::DispatchKey::CPU, TORCH_FN(mm));
  m.def("isa() -> str", []() -> std::string {  // the vector path this build compiled
#if defined(PD_AVX512)
    return "avx512";
#elif defined(PD_AVX2)
    return "avx2";
#else
    return "portable";
#endif
  });
}
"""


def _cflags() -> list[str]:
    return cpp_build.simd_cflags()


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the extension; None when it works, else why it cannot be used."""
    return build(SOURCE, _cflags())


def build(source: str, cflags: list[str]) -> str | None:
    """Compiles ``source`` into the cache dir (unless already built) and loads it; None, or the reason it failed."""
    reason = cpp_build.build("pdserve_qf32", source, cflags, "the f32_cpu kernel")
    if reason:
        log.warning("%s; float32 quantized linears fall back to dequant", reason)
    return reason


def _pack4(u: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/2) bytes: byte j of each 32-code block = u[j] | u[j + 16] << 4."""
    n, k = u.shape
    g = u.view(n, k // 32, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class F32Linear(KernelLinear):
    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.dtype, self.bits, self.group_size = torch.float32, w.bits, w.group_size
        self.is_signed = w.q.dtype == torch.int8
        if w.bits == 4:
            u = w.q.to(torch.int16) + (8 if self.is_signed else 0)
            if int(u.min()) < 0 or int(u.max()) > 15:
                raise ValueError(f"{w.fmt}: 4-bit codes out of range [{int(u.min())}, {int(u.max())}]")
            codes = _pack4(u.to(torch.uint8))
        else:  # the loader's own tensors, not copies: a tied LM head shares the Q8_0 embedding's codes and scales
            codes = w.q.contiguous()
        self.register_buffer("codes", codes.to(device))
        self.register_buffer("scale", w.scale.float().contiguous().to(device))
        self.register_buffer("zero", None if w.zero is None else w.zero.float().contiguous().to(device))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=torch.float32))

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:  # (T, K) float32 -> (T, N) float32
        return torch.ops.pdserve_qf32.mm(x2, self.codes, self.scale, self.zero, self.bits, self.group_size,
                                         self.is_signed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # KernelLinear's, minus no-op casts: ~121 calls a token
        if x.dtype != torch.float32:
            return super().forward(x)
        y = self.matmul(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


@register_linear_method("f32_cpu")
class F32CpuMethod(DeviceLinearMethod):
    name = "f32_cpu"
    priority = 0  # float32 on CPU: ahead of dequant (exact but rebuilds the float weight every step)

    def supports(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype != torch.float32:
            return "float32 activations only"
        return super().supports(weight, device, dtype)

    def check(self, weight: QuantizedWeight) -> str | None:
        step = {4: 32, 8: 16}.get(weight.bits)
        if step is None:
            return f"{weight.bits}-bit codes are not supported"
        if weight.group_size % step or weight.shape[1] % weight.group_size:
            return f"needs the group size a multiple of {step} dividing in_features " \
                   f"(got {weight.group_size}, {weight.shape[1]})"
        if weight.q.dtype not in (torch.int8, torch.uint8):
            return f"needs int8 or uint8 codes, got {weight.q.dtype}"
        return load_extension()

    def module_class(self, weight: QuantizedWeight) -> type[QuantLinearModule]:
        return F32Linear
