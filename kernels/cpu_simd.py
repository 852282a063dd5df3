"""C++ snippets shared by the CPU kernels (kernels/paged_decode_cpu.py, kernels/paged_prefill_cpu.py, kernels/fused_cpu.py,
kernels/amx_linear.py).

``AVX512_HELPERS`` (inside ``#ifdef PD_AVX512``, after ``<immintrin.h>``): ``load16`` (16 floats or bf16s as floats),
``exp16`` (e^x for x <= 0, 0 below -87), ``round16`` (16 floats rounded to bf16, kept as floats) and ``FlushDenormals`` (flush-to-zero / denormals-are-zero for a scope).
``AVX2_HELPERS`` (inside ``#ifdef PD_AVX2``, AVX2 + FMA, after ``<immintrin.h>``): the same on 8 lanes, ``load8``,
``exp8``, ``round8``, with ``hsum8`` / ``hmax8`` (a vector's sum / max) and ``FlushDenormals``.
``TRANSPOSE16`` (after ``<immintrin.h>``, AVX-512 F): ``transpose16``, a 16 x 16 transpose of 32-bit words in registers.
``AMX_HELPERS`` (after ``<sys/syscall.h>`` and ``<unistd.h>``, compiled with ``-mamx-tile -mamx-bf16``): ``Tiles``
(a thread's AMX tile configuration for a scope, every tile 16 x 64 bytes) and ``amx_permitted`` (asks Linux for AMX).
``STACK_PREAMBLE`` (a source's start, kernels/layer_stack_cpu.py and kernels/layer_stack_f32_cpu.py): the headers,
``OptT``, ``op<Sig>(name)`` (an op's typed dispatcher handle) and the signatures of the RMSNorm, RoPE, SiLU * up and
paged decode ops the layer stacks call.
"""

FLUSH_DENORMALS = r"""
// Flush-to-zero / denormals-are-zero while a thread runs the kernel: peaked softmaxes leave probabilities whose
// products with V are subnormal, and x86 takes a ~100x slower microcode path on every one of them.
struct FlushDenormals {
  unsigned int saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};
"""

AVX512_HELPERS = r"""
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16 -> f32: the 16 bits are the top half of the float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// e^x for x <= 0 (scores minus their max): 2^n * p(r), |r| <= ln2/2, degree-6 polynomial (relative error ~2e-7);
// 0 below -87, where e^x leaves float32's normal range
inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

// x rounded to the nearest bf16 (ties to even), kept as a float: (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000
inline __m512 round16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}
""" + FLUSH_DENORMALS

AVX2_HELPERS = r"""
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16 -> f32: the 16 bits are the top half of the float
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// exp16's polynomial on 8 lanes: e^x for x <= 0, 0 below -87
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
// x rounded to the nearest bf16 (ties to even), kept as a float, as round16
inline __m256 round8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
}
""" + FLUSH_DENORMALS

AMX_HELPERS = r"""
// AMX tiles for one thread: every tile 16 rows of 64 bytes (16 x 32 bf16 as pairs for A and B, 16 x 16 floats
// for C), but the tiles in ``short_tiles`` (bit i: tile i) with ``rows`` rows (a product's last C and A row tiles:
// loads and stores then touch only those rows). Whatever configuration the thread had (oneDNN's) is put back
// afterwards.
struct Tiles {
  struct Config { uint8_t palette = 1, start = 0, pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
  alignas(64) Config saved;
  explicit Tiles(unsigned short_tiles = 0, int rows = 16) {
    // GCC 12 does not count sttilecfg / ldtilecfg as touching their 64 bytes: where this was not inlined it dropped
    // cfg's stores below as dead and loaded an invalid configuration (SIGSEGV). The barriers order every access.
    asm volatile("" : : "r"(&saved) : "memory");
    _tile_storeconfig(&saved);
    asm volatile("" : : "r"(&saved) : "memory");
    Config cfg;
    for (int i = 0; i < 8; i++) { cfg.colsb[i] = 64; cfg.rows[i] = (short_tiles >> i) & 1 ? (uint8_t)rows : 16; }
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { if (saved.palette) _tile_loadconfig(&saved); else _tile_release(); }
};

// Linux hands out AMX state only to a process that asks for it (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

"""

TRANSPOSE16 = r"""
// 16 x 16 32-bit words, in registers: r[i] holds row i, then column i
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // lane L of r[k + j] now: column 4L + j of rows k .. k + 3
    r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int j = 0; j < 4; j++) {
    const __m512i v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), v2 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88), w2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    t[4 + j] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(v2, w2, 0xDD);
  }
  for (int i = 0; i < 16; i++) r[i] = t[i];
}
"""

STACK_PREAMBLE = r"""
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {
using OptT = c10::optional<at::Tensor>;

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using RmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptT&, const at::Tensor&, double);
using Rope = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using SiluMul = at::Tensor(const at::Tensor&);
using Decode = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
}  // namespace
"""
