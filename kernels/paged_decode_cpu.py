"""Paged decode attention on CPU: a torch C++ extension that reads K/V blocks in place through the block tables.

One query token per sequence, ``q (B, H, D)``, over the first ``seq_lens[b]`` slots its block table names in one layer
of the block-major cache ``kv_layer (num_blocks, 2, block_size, Hkv, D)`` (any block and K/V strides; each block's
``(block_size, Hkv, D)`` contiguous). Per (sequence, KV head): the scores of the head's query group (GQA: each K/V row
is loaded once for its G query heads), a float32 softmax, then the weighted sum of V, all accumulated in float32, for a
float32 or bfloat16 cache. Work items are spread over torch's thread pool (``at::parallel_for``).

Why: the torch path (kernels/torch_ref.py) gathers a padded copy of every context per layer, then multiplies
block-diagonal queries (Hkv x the FLOPs) so that both products stay GEMMs: at 32 sequences that was the largest cost
of a decode step outside the linears (``benchmarks/profile_step.py``). Reading each K/V row once, in place, moves a
third of the bytes. Over a bf16 cache it rounds the scores and the probabilities to bf16 where the torch path's bf16
GEMMs do, so that its bf16 output tracks the eager path's; it is not bit-equal to it (float32 sums in another order).
tests/kernels/test_paged_decode_cpu.py checks it against float64 and the eager bf16 path; the engine's float32 greedy
parity tests run on it.

Built on first use (kernels/cpp_build.py); AVX-512 intrinsics where the CPU has them; else 8-lane AVX2 + FMA vectors
where the CPU has those (AMD Zen 2/3, Intel before Cooper Lake): for common shapes (GQA group 1-4, 7, 8; head dim 64
or 128; a block size that is a multiple of 8) a fixed-shape item that scores 8 K rows at a time and keeps its V sums
in registers (float32, one layer of the default model, cold cache: 1.5 -> 0.86 ms at 32 sequences, 3.0 -> 1.8 ms at
64); with enough sequences for every thread, one item per sequence that reads each block's K (then V) rows for all
heads as one span and asks for the next block's while it computes (the same sums per head; 1.3 -> 0.87 ms at 32
sequences of 400 tokens, the cache on huge pages); else the generic loop's dot products, softmax and V sums (3-12x the
plain loop); or plain C++ (``isa()`` says which). If the build fails the torch path is used (one warning).
``PDSERVE_CPU_DECODE_ATTENTION=torch`` forces the torch path.
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build
from pdserve.kernels.cpu_simd import AVX2_HELPERS, AVX512_HELPERS

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
#endif

namespace {

// float -> the nearest bf16 (ties to even), kept as a float: how the torch path rounds its bf16 scores and probabilities
inline float round_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&f, &u, 4); return f;
}

inline float to_f(float x) { return x; }
inline float to_f(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }

#ifdef PD_AVX512
""" + AVX512_HELPERS + r"""
#elif defined(PD_AVX2)
""" + AVX2_HELPERS + r"""
#else
struct FlushDenormals {};
#endif

struct Args {
  const float* q; float* out; const int64_t* tables; const int64_t* lens;
  int64_t B, H, Hkv, D, nb, bs, s_block, s_kv; float scale;
};

// Softmax of each of the G rows of sc (G x L), in place; with to_bf16, the probabilities rounded to bf16.
void softmax_rows(float* sc, int64_t G, int64_t L, bool to_bf16) {
  for (int64_t g = 0; g < G; g++) {
    float* s = sc + g * L, m = -INFINITY, sum = 0.f;
    int64_t t = 0;
#ifdef PD_AVX512
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; t + 16 <= L; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    m = _mm512_reduce_max_ps(vmax);
#elif defined(PD_AVX2)
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= L; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    m = hmax8(vmax);
#endif
    for (; t < L; t++) m = std::max(m, s[t]);
    t = 0;
#ifdef PD_AVX512
    __m512 vs = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
    for (; t + 16 <= L; t += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
      _mm512_storeu_ps(s + t, e);
      vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#elif defined(PD_AVX2)
    __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(m);
    for (; t + 8 <= L; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
      _mm256_storeu_ps(s + t, e);
      vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#endif
    for (; t < L; t++) { s[t] = std::exp(s[t] - m); sum += s[t]; }
    const float inv = 1.f / sum;
    t = 0;
#ifdef PD_AVX512
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; t + 16 <= L; t += 16) {
      const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s + t), vinv);
      _mm512_storeu_ps(s + t, to_bf16 ? round16(p) : p);
    }
#elif defined(PD_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; t + 8 <= L; t += 8) {
      const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(s + t), vinv);
      _mm256_storeu_ps(s + t, to_bf16 ? round8(p) : p);
    }
#endif
    if (to_bf16)
      for (; t < L; t++) s[t] = round_bf16(s[t] * inv);
    else
      for (; t < L; t++) s[t] *= inv;
  }
}

// q . k over D, summed in float32: in 8 lanes with AVX2 where D is a multiple of 8, else in order
template <typename KV>
inline float dot(const float* q, const KV* k, int64_t D) {
#ifdef PD_AVX2
  if (D % 8 == 0) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
    for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
    return hsum8(acc);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; d++) s += q[d] * to_f(k[d]);
  return s;
}

// out += w * v over D
template <typename KV>
inline void axpy(float* out, float w, const KV* v, int64_t D) {
#ifdef PD_AVX2
  if (D % 8 == 0) {
    const __m256 vw = _mm256_set1_ps(w);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(vw, load8(v + d), _mm256_loadu_ps(out + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; d++) out[d] += w * to_f(v[d]);
}

// One (sequence b, KV head kh), any group size and head dim: its G query heads' scores over the context, softmax,
// weighted V sum.
template <typename KV>
void item(const Args& a, const KV* kv, int64_t b, int64_t kh, std::vector<float>& sc) {
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t G = a.H / a.Hkv, D = a.D, L = a.lens[b], row = a.Hkv * D;
  const float* q = a.q + (b * a.H + kh * G) * D;
  const int64_t* table = a.tables + b * a.nb;
  sc.resize(G * L);
  for (int64_t t = 0; t < L; t++) {
    const KV* k = kv + table[t / a.bs] * a.s_block + (t % a.bs) * row + kh * D;
    for (int64_t g = 0; g < G; g++) {
      const float s = dot(q + g * D, k, D);
      sc[g * L + t] = bf16 ? round_bf16(s) * a.scale : s * a.scale;
    }
  }
  softmax_rows(sc.data(), G, L, bf16);
  float* out = a.out + (b * a.H + kh * G) * D;
  std::fill(out, out + G * D, 0.f);
  for (int64_t t = 0; t < L; t++) {
    const KV* v = kv + a.s_kv + table[t / a.bs] * a.s_block + (t % a.bs) * row + kh * D;
    for (int64_t g = 0; g < G; g++) axpy(out + g * D, sc[g * L + t], v, D);
  }
}

#ifdef PD_AVX512
// Asks for row r of one head in the next block (next: its first row; nullptr: none) while row r of this block is
// computed. Spread over the rows like this, the next block's loads overlap this block's arithmetic; a whole block
// asked for at once (96 lines) filled every line-fill buffer and stalled until it arrived, so loads and arithmetic
// took turns (1.4-2.6x at 1-64 sequences, benchmarks/RESULTS.md). Consecutive blocks of a layer sit a whole block
// apart (every layer's K and V in between), past any page the hardware prefetcher would follow.
template <typename KV, int DV>
inline void prefetch_row(const KV* next, int64_t r, int64_t row) {
  if (next == nullptr) return;
  const char* p = (const char*)(next + r * row);
  for (int64_t o = 0; o < 16 * DV * (int64_t)sizeof(KV); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// out[i] = the sum of the 16 floats of row v[i], for 16 rows at once (a transposing tree: ~3 shuffles and adds a row
// where a horizontal sum per row takes ~10).
inline __m512 sum16(const float (*v)[16]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; i++) {
    const __m512 p = _mm512_load_ps(v[2 * i]), q = _mm512_load_ps(v[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q));
  }
  for (int i = 0; i < 4; i++) {
    const __m512d p = _mm512_castps_pd(w[2 * i]), q = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

// The scaled scores of G query heads (qv: registers) over `rows` consecutive K rows of one head in one block (k: the
// first row, rows a.Hkv * D apart), into s[g * L + r], asking for the rows of `next` as it goes (prefetch_row).
// bf16: the products of 16 rows are summed at once (sum16) and rounded to bf16 as the torch path's bf16 GEMM does;
// float32 keeps one horizontal sum per row (the order the float32 parity tests run on).
template <typename KV, int G, int DV>
inline void block_scores(const Args& a, const __m512 (&qv)[G][DV], const KV* k, int64_t rows, float* s, int64_t L,
                         const KV* next) {
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t row = a.Hkv * 16 * DV;
  __m512 x[DV];
  if constexpr (bf16) {
    alignas(64) float part[G][16][16];   // rows past `rows` stay unset: their lanes are never stored
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t n = std::min<int64_t>(16, rows - r0);
      for (int64_t r = 0; r < n; r++) {
        prefetch_row<KV, DV>(next, r0 + r, row);
        for (int j = 0; j < DV; j++) x[j] = load16(k + (r0 + r) * row + 16 * j);
        for (int g = 0; g < G; g++) {
          __m512 acc = _mm512_mul_ps(qv[g][0], x[0]);
          for (int j = 1; j < DV; j++) acc = _mm512_fmadd_ps(qv[g][j], x[j], acc);
          _mm512_store_ps(part[g][r], acc);
        }
      }
      for (int g = 0; g < G; g++)
        _mm512_mask_storeu_ps(s + g * L + r0, (__mmask16)((1u << n) - 1),
                              _mm512_mul_ps(round16(sum16(part[g])), _mm512_set1_ps(a.scale)));
    }
  } else {
    for (int64_t r = 0; r < rows; r++) {
      prefetch_row<KV, DV>(next, r, row);
      for (int j = 0; j < DV; j++) x[j] = load16(k + r * row + 16 * j);
      for (int g = 0; g < G; g++) {
        __m512 acc = _mm512_mul_ps(qv[g][0], x[0]);
        for (int j = 1; j < DV; j++) acc = _mm512_fmadd_ps(qv[g][j], x[j], acc);
        s[g * L + r] = _mm512_reduce_add_ps(acc) * a.scale;
      }
    }
  }
}

// Adds the probability-weighted V rows of one head in one block (v: the first row) to G output rows (o: registers),
// asking for the rows of `next` as it goes.
template <typename KV, int G, int DV>
inline void block_values(const Args& a, __m512 (&o)[G][DV], const KV* v, int64_t rows, const float* p, int64_t L,
                         const KV* next) {
  const int64_t row = a.Hkv * 16 * DV;
  __m512 x[DV];
  for (int64_t r = 0; r < rows; r++) {
    prefetch_row<KV, DV>(next, r, row);
    for (int j = 0; j < DV; j++) x[j] = load16(v + r * row + 16 * j);
    for (int g = 0; g < G; g++) {
      const __m512 w = _mm512_set1_ps(p[g * L + r]);
      for (int j = 0; j < DV; j++) o[g][j] = _mm512_fmadd_ps(w, x[j], o[g][j]);
    }
  }
}

template <int G, int DV>
inline void load_rows(__m512 (&r)[G][DV], const float* p) {
  for (int g = 0; g < G; g++)
    for (int j = 0; j < DV; j++) r[g][j] = _mm512_loadu_ps(p + g * 16 * DV + 16 * j);
}

template <int G, int DV>
inline void store_rows(const __m512 (&r)[G][DV], float* p) {
  for (int g = 0; g < G; g++)
    for (int j = 0; j < DV; j++) _mm512_storeu_ps(p + g * 16 * DV + 16 * j, r[g][j]);
}

// The same for a fixed group size G and head dim 16 * DV: the query group and the output accumulators live in
// registers, and each K/V row is loaded (and converted) once for the whole group.
template <typename KV, int G, int DV>
void item_fixed(const Args& a, const KV* kv, int64_t b, int64_t kh, std::vector<float>& sc) {
  constexpr int64_t D = 16 * DV;
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t L = a.lens[b], nblk = (L + a.bs - 1) / a.bs;
  const int64_t* table = a.tables + b * a.nb;
  sc.resize(G * L);
  const auto k_at = [&](int64_t i) { return kv + table[i] * a.s_block + kh * D; };  // the head's first K row
  __m512 qv[G][DV], o[G][DV];
  load_rows<G, DV>(qv, a.q + (b * a.H + kh * G) * D);
  for (int64_t i = 0; i < nblk; i++)  // the last K block asks for the first V block
    block_scores<KV, G, DV>(a, qv, k_at(i), std::min(a.bs, L - i * a.bs), sc.data() + i * a.bs, L,
                            i + 1 < nblk ? k_at(i + 1) : k_at(0) + a.s_kv);
  softmax_rows(sc.data(), G, L, bf16);
  for (int g = 0; g < G; g++)
    for (int j = 0; j < DV; j++) o[g][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nblk; i++)
    block_values<KV, G, DV>(a, o, k_at(i) + a.s_kv, std::min(a.bs, L - i * a.bs), sc.data() + i * a.bs, L,
                            i + 1 < nblk ? k_at(i + 1) + a.s_kv : nullptr);
  store_rows<G, DV>(o, a.out + (b * a.H + kh * G) * D);
}

// One whole sequence, every KV head, block by block (many sequences per step): a block's rows hold all heads side by
// side, so a layer-block's K (then V) is one contiguous span, read once for all heads, instead of each head's slice of
// it being fetched from memory on its own (benchmarks/RESULTS.md: 1.5-1.9x at 1-64 sequences).
// Same arithmetic per head as item_fixed.
template <typename KV, int G, int DV>
void seq_fixed(const Args& a, const KV* kv, int64_t b, std::vector<float>& sc) {
  constexpr int64_t D = 16 * DV;
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t L = a.lens[b], nblk = (L + a.bs - 1) / a.bs;
  const int64_t* table = a.tables + b * a.nb;
  const auto k_at = [&](int64_t i) { return kv + table[i] * a.s_block; };  // the block's first K row
  sc.resize(a.Hkv * G * L);
  __m512 qv[G][DV], o[G][DV];
  for (int64_t i = 0; i < nblk; i++) {  // the last K block asks for the first V block
    const KV* next = i + 1 < nblk ? k_at(i + 1) : k_at(0) + a.s_kv;
    for (int64_t kh = 0; kh < a.Hkv; kh++) {
      load_rows<G, DV>(qv, a.q + (b * a.H + kh * G) * D);
      block_scores<KV, G, DV>(a, qv, k_at(i) + kh * D, std::min(a.bs, L - i * a.bs),
                              sc.data() + kh * G * L + i * a.bs, L, next + kh * D);
    }
  }
  softmax_rows(sc.data(), a.Hkv * G, L, bf16);
  float* out = a.out + b * a.H * D;
  std::fill(out, out + a.H * D, 0.f);
  for (int64_t i = 0; i < nblk; i++) {
    const KV* next = i + 1 < nblk ? k_at(i + 1) + a.s_kv : nullptr;
    for (int64_t kh = 0; kh < a.Hkv; kh++) {
      load_rows<G, DV>(o, out + kh * G * D);
      block_values<KV, G, DV>(a, o, k_at(i) + a.s_kv + kh * D, std::min(a.bs, L - i * a.bs),
                              sc.data() + kh * G * L + i * a.bs, L, next ? next + kh * D : nullptr);
      store_rows<G, DV>(o, out + kh * G * D);
    }
  }
}
#elif defined(PD_AVX2)
// The partial sums of 4 rows (each 8 lanes) -> [r0 r1 r2 r3 (lanes 0-3) | r0 r1 r2 r3 (lanes 4-7)]
inline __m256 pair_sums4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  return _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
}

// q . k for the n <= 4 rows k, k + row, ... (the rest 0), as pair_sums4 lays them out; q: one head in registers
template <typename KV, int DV>
inline __m256 dots4(const __m256 (&qv)[DV], const KV* k, int64_t row, int64_t n) {
  __m256 acc[4];
  for (int r = 0; r < 4; r++) {
    acc[r] = _mm256_setzero_ps();
    if (r < n)
      for (int j = 0; j < DV; j++) acc[r] = _mm256_fmadd_ps(qv[j], load8(k + r * row + 8 * j), acc[r]);
  }
  return pair_sums4(acc[0], acc[1], acc[2], acc[3]);
}

// The scaled scores of one query head q (D = 8 * DV floats) over `rows` K rows of one block (k: the first, rows `row`
// floats apart) into dst: 8 rows at a time, their sums reduced together by horizontal adds (dots4); over a bf16 cache
// rounded to bf16 first, as the torch path's bf16 GEMM rounds them.
template <typename KV, int DV>
inline void scores8(const float* q, const KV* k, int64_t row, int64_t rows, __m256 scale, float* dst) {
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  __m256 qv[DV];
  for (int j = 0; j < DV; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
  for (int64_t r = 0; r < rows; r += 8) {
    const int64_t n = std::min<int64_t>(8, rows - r);
    const __m256 lo = dots4<KV, DV>(qv, k + r * row, row, n), hi = dots4<KV, DV>(qv, k + (r + 4) * row, row, n - 4);
    __m256 tot = _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
    tot = _mm256_mul_ps(bf16 ? round8(tot) : tot, scale);
    if (n == 8) {
      _mm256_storeu_ps(dst + r, tot);
    } else {
      alignas(32) float part[8];
      _mm256_store_ps(part, tot);
      std::memcpy(dst + r, part, n * sizeof(float));
    }
  }
}

// One (sequence b, KV head kh) for a fixed group size G and head dim 8 * DV, on AVX2's 16 vector registers: each
// query head's scores 8 K rows at a time (the head in registers, the 8 rows' sums reduced together by horizontal adds
// where one horizontal sum per row costs ~4x the work), then the V sums with the G x H output vectors in registers,
// H of the head's DV vectors at a time (G * H <= 12). The V sums add in the generic item's order; the scores' sums in
// another (float32 rounding apart). A block size that is not a multiple of 8 takes the generic item.
template <typename KV, int G, int DV>
void item_fixed8(const Args& a, const KV* kv, int64_t b, int64_t kh, std::vector<float>& sc) {
  if (a.bs % 8 != 0) return item<KV>(a, kv, b, kh, sc);
  constexpr int64_t D = 8 * DV;
  constexpr int H = G * DV <= 12 ? DV : (G <= 3 && DV % 4 == 0 ? 4 : (G <= 6 && DV % 2 == 0 ? 2 : 1));
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t L = a.lens[b], row = a.Hkv * D, nblk = (L + a.bs - 1) / a.bs;
  const int64_t* table = a.tables + b * a.nb;
  const float* q = a.q + (b * a.H + kh * G) * D;
  sc.resize(G * L);
  float* s = sc.data();
  const __m256 scale = _mm256_set1_ps(a.scale);
  const auto k_at = [&](int64_t i) { return kv + table[i] * a.s_block + kh * D; };  // the head's first K row
  for (int64_t i = 0; i < nblk; i++) {
    const KV* k = k_at(i);
    const int64_t rows = std::min(a.bs, L - i * a.bs);
    for (int g = 0; g < G; g++) scores8<KV, DV>(q + g * D, k, row, rows, scale, s + g * L + i * a.bs);
  }
  softmax_rows(s, G, L, bf16);
  float* out = a.out + (b * a.H + kh * G) * D;
  for (int h = 0; h < DV; h += H) {
    __m256 o[G][H];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < H; j++) o[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nblk; i++) {
      const KV* v = k_at(i) + a.s_kv + 8 * h;
      const float* p = s + i * a.bs;
      for (int64_t r = 0, rows = std::min(a.bs, L - i * a.bs); r < rows; r++) {
        for (int g = 0; g < G; g++) {
          const __m256 w = _mm256_set1_ps(p[g * L + r]);
          for (int j = 0; j < H; j++) o[g][j] = _mm256_fmadd_ps(w, load8(v + r * row + 8 * j), o[g][j]);
        }
      }
    }
    for (int g = 0; g < G; g++)
      for (int j = 0; j < H; j++) _mm256_storeu_ps(out + g * D + 8 * (h + j), o[g][j]);
  }
}
// One whole sequence, every KV head, block by block (many sequences per step), with the same sums per head as
// item_fixed8 (the same bits). A block's K (then V) rows hold all heads side by side, so each is read as one
// contiguous span, and the next block's span is asked for (_mm_prefetch) a slice per head while this block is
// computed: without that, loads and arithmetic took turns (float32, one layer of the default model at 32 sequences of
// 400 tokens, cold cache on huge pages: 1.3 -> 0.87 ms; benchmarks/RESULTS.md).
template <typename KV, int G, int DV>
void seq_fixed8(const Args& a, const KV* kv, int64_t b, std::vector<float>& sc) {
  if (a.bs % 8 != 0) {
    for (int64_t kh = 0; kh < a.Hkv; kh++) item<KV>(a, kv, b, kh, sc);
    return;
  }
  constexpr int64_t D = 8 * DV;
  constexpr bool bf16 = std::is_same<KV, uint16_t>::value;
  const int64_t L = a.lens[b], row = a.Hkv * D, nblk = (L + a.bs - 1) / a.bs, HG = a.Hkv * G;
  const int64_t lines = a.bs * row * (int64_t)sizeof(KV) / 64;   // one block's K (or V): whole 64-byte lines
  const int64_t* table = a.tables + b * a.nb;
  const auto ask = [&](const KV* next, int64_t h) {   // slice h of HG of the block at `next`
    if (next != nullptr)
      for (int64_t l = h * lines / HG; l < (h + 1) * lines / HG; l++) _mm_prefetch((const char*)next + 64 * l, _MM_HINT_T0);
  };
  sc.resize(HG * L);
  float* s = sc.data();
  const __m256 scale = _mm256_set1_ps(a.scale);
  const float* q = a.q + b * a.H * D;
  for (int64_t i = 0; i < nblk; i++) {   // the last K block asks for the first V block
    const KV* blk = kv + table[i] * a.s_block;
    const KV* next = i + 1 < nblk ? kv + table[i + 1] * a.s_block : kv + table[0] * a.s_block + a.s_kv;
    const int64_t rows = std::min(a.bs, L - i * a.bs);
    for (int64_t h = 0; h < HG; h++) {
      ask(next, h);
      scores8<KV, DV>(q + h * D, blk + (h / G) * D, row, rows, scale, s + h * L + i * a.bs);
    }
  }
  softmax_rows(s, HG, L, bf16);
  float* out = a.out + b * a.H * D;
  std::fill(out, out + a.H * D, 0.f);
  for (int64_t i = 0; i < nblk; i++) {
    const KV* blk = kv + table[i] * a.s_block + a.s_kv;
    const KV* next = i + 1 < nblk ? kv + table[i + 1] * a.s_block + a.s_kv : nullptr;
    for (int64_t h = 0, rows = std::min(a.bs, L - i * a.bs); h < HG; h++) {
      ask(next, h);
      const KV* v = blk + (h / G) * D;
      const float* p = s + h * L + i * a.bs;
      __m256 o[DV];
      for (int j = 0; j < DV; j++) o[j] = _mm256_loadu_ps(out + h * D + 8 * j);
      for (int64_t r = 0; r < rows; r++) {
        const __m256 w = _mm256_set1_ps(p[r]);
        for (int j = 0; j < DV; j++) o[j] = _mm256_fmadd_ps(w, load8(v + r * row + 8 * j), o[j]);
      }
      for (int j = 0; j < DV; j++) _mm256_storeu_ps(out + h * D + 8 * j, o[j]);
    }
  }
}
#endif

using ItemFn = void (*)(const Args&, const void*, int64_t, int64_t, std::vector<float>&);
using SeqFn = void (*)(const Args&, const void*, int64_t, std::vector<float>&);

// A whole-sequence work item for the default model's shapes (G 3, head dim 64) or its neighbours: with AVX-512 for a
// bf16 cache, with AVX2 for either; nullptr elsewhere (the per-head items serve).
SeqFn pick_seq(bool bf16, int64_t G, int64_t D) {
#ifdef PD_AVX512
#define PD_SEQ(g, dv) \
  if (bf16 && G == g && D == 16 * dv) \
    return [](const Args& a, const void* kv, int64_t b, std::vector<float>& sc) { \
      seq_fixed<uint16_t, g, dv>(a, (const uint16_t*)kv, b, sc); };
  PD_SEQ(1, 4) PD_SEQ(2, 4) PD_SEQ(3, 4) PD_SEQ(4, 4) PD_SEQ(8, 4) PD_SEQ(1, 8) PD_SEQ(2, 8) PD_SEQ(4, 8)
#undef PD_SEQ
#elif defined(PD_AVX2)
#define PD_SEQ8(g, dv) \
  if (G == g && D == 8 * dv) \
    return bf16 ? SeqFn([](const Args& a, const void* kv, int64_t b, std::vector<float>& sc) { \
                    seq_fixed8<uint16_t, g, dv>(a, (const uint16_t*)kv, b, sc); }) \
                : SeqFn([](const Args& a, const void* kv, int64_t b, std::vector<float>& sc) { \
                    seq_fixed8<float, g, dv>(a, (const float*)kv, b, sc); });
  PD_SEQ8(1, 8) PD_SEQ8(2, 8) PD_SEQ8(3, 8) PD_SEQ8(4, 8) PD_SEQ8(8, 8) PD_SEQ8(1, 16) PD_SEQ8(2, 16) PD_SEQ8(4, 16)
#undef PD_SEQ8
#endif
  return nullptr;
}

template <typename KV>
ItemFn pick(int64_t G, int64_t D) {
#ifdef PD_AVX512
#define PD_FIXED(g, dv) \
  if (G == g && D == 16 * dv) \
    return [](const Args& a, const void* kv, int64_t b, int64_t kh, std::vector<float>& sc) { \
      item_fixed<KV, g, dv>(a, (const KV*)kv, b, kh, sc); };
  PD_FIXED(1, 4) PD_FIXED(2, 4) PD_FIXED(3, 4) PD_FIXED(4, 4) PD_FIXED(7, 4) PD_FIXED(8, 4)
  PD_FIXED(1, 8) PD_FIXED(2, 8) PD_FIXED(3, 8) PD_FIXED(4, 8) PD_FIXED(7, 8) PD_FIXED(8, 8)
#undef PD_FIXED
#elif defined(PD_AVX2)
#define PD_FIXED8(g, dv) \
  if (G == g && D == 8 * dv) \
    return [](const Args& a, const void* kv, int64_t b, int64_t kh, std::vector<float>& sc) { \
      item_fixed8<KV, g, dv>(a, (const KV*)kv, b, kh, sc); };
  PD_FIXED8(1, 8) PD_FIXED8(2, 8) PD_FIXED8(3, 8) PD_FIXED8(4, 8) PD_FIXED8(7, 8) PD_FIXED8(8, 8)
  PD_FIXED8(1, 16) PD_FIXED8(2, 16) PD_FIXED8(3, 16) PD_FIXED8(4, 16) PD_FIXED8(7, 16) PD_FIXED8(8, 16)
#undef PD_FIXED8
#endif
  return [](const Args& a, const void* kv, int64_t b, int64_t kh, std::vector<float>& sc) {
    item<KV>(a, (const KV*)kv, b, kh, sc); };
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& tables, const at::Tensor& lens,
                  double scale) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q: float32 or bf16 (B, H, D)");
  const at::Tensor qf = q.to(at::kFloat).contiguous();  // the sums are float32 either way; no copy for float32
  TORCH_CHECK(kv_layer.dim() == 5, "kv_layer: (num_blocks, 2, block_size, Hkv, D)");
  TORCH_CHECK(kv_layer.scalar_type() == at::kFloat || kv_layer.scalar_type() == at::kBFloat16, "kv: float32 or bf16");
  const int64_t bs = kv_layer.size(2), Hkv = kv_layer.size(3), D = kv_layer.size(4), B = q.size(0), H = q.size(1);
  TORCH_CHECK(kv_layer.stride(4) == 1 && kv_layer.stride(3) == D && kv_layer.stride(2) == Hkv * D,
              "kv_layer: each block's (block_size, Hkv, D) contiguous");
  TORCH_CHECK(q.size(2) == D && H % Hkv == 0, "q: head_dim of the cache, heads a multiple of the KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "tables: contiguous int64 (B, nb)");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "lens: contiguous int64 (B,)");
  const int64_t nb = tables.size(1), num_blocks = kv_layer.size(0);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) {  // never read outside the cache: lengths within the table, ids within the cache
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "lens: 1..nb * block_size");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; i++)
      TORCH_CHECK(tp[b * nb + i] >= 0 && tp[b * nb + i] < num_blocks, "tables: block id out of range");
  }
  at::Tensor out = at::empty({B, H, D}, qf.options());
  const Args a{qf.data_ptr<float>(), out.data_ptr<float>(), tp, lp, B, H, Hkv, D, nb, bs,
               kv_layer.stride(0), kv_layer.stride(1), float(scale)};
  const void* kv = kv_layer.data_ptr();
  // Enough sequences to keep every thread busy: one item per sequence, its blocks read whole (seq_fixed)
  const SeqFn seq = pick_seq(kv_layer.scalar_type() == at::kBFloat16, H / Hkv, D);
  if (seq != nullptr && B >= 2 * at::get_num_threads()) {
    at::parallel_for(0, B, 1, [&](int64_t i0, int64_t i1) {
      FlushDenormals ftz;
      std::vector<float> sc;
      for (int64_t i = i0; i < i1; i++) seq(a, kv, i, sc);
    });
    return out.to(q.scalar_type());
  }
  const ItemFn fn = kv_layer.scalar_type() == at::kFloat ? pick<float>(H / Hkv, D) : pick<uint16_t>(H / Hkv, D);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;
    std::vector<float> sc;
    for (int64_t i = i0; i < i1; i++) fn(a, kv, i / Hkv, i % Hkv, sc);
  });
  return out.to(q.scalar_type());
}
}  // namespace

TORCH_LIBRARY(pdserve_paged_cpu, m) {
  m.def("decode(Tensor q, Tensor kv_layer, Tensor tables, Tensor lens, float scale) -> Tensor");
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
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


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the kernel; None when it works, else why it cannot be used."""
    reason = cpp_build.build("pdserve_paged_cpu", SOURCE, cpp_build.simd_cflags(), "the paged decode attention kernel")
    if reason:
        log.warning("%s; CPU decode attention uses the torch path", reason)
    return reason


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on ``device`` over a ``dtype`` cache runs this kernel (built, not switched off)."""
    from pdserve.runtime import envs

    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and envs.cpu_decode_attention() == "paged" and load_extension() is None)


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q (B, H, D) over each sequence's first ``lens[b]`` slots of the blocks ``tables[b]`` names -> (B, H, D), q's
    dtype. ``tables`` (B, nb) and ``lens`` (B,) int64 and contiguous."""
    if reason := load_extension():
        raise RuntimeError(reason)
    return torch.ops.pdserve_paged_cpu.decode(q, kv_layer, tables, lens, scale)   # converts q and out in C++
