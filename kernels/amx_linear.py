"""Dense bf16 linears on CPU on AMX tiles, the weight pre-packed once into the tiles' pair-interleaved layout.

``x (M, K) @ w.T (+ b) -> (M, N)``: the weight is stored as ``(N/16, K/32, 16, 32)`` bf16 (zero-padded), so the 16
output columns of one block stream their whole K contiguously, 1 KiB per tile; each thread takes a range of column
blocks (from 17 rows, then the blocks left two at a time once it is done) and, for up to 64 rows at a time,
accumulates up to four 16 x 16 float32 tiles (``tdpbf16ps``), then rounds them (plus the bias) to bf16 once, as
oneDNN's bf16 GEMM does. Rows are padded to a multiple of 16 and K to 32.

Why: a decode step multiplies a few to a few dozen rows by every weight of the model, so it costs reading the
weights, and oneDNN's packed linear (kernels/packed_linear.py) read them well below this host's memory bandwidth at
those row counts; a column block per tile stream keeps the reads sequential and the products (16 rows of K 32 per
instruction) far from the limit. The engine uses it up to :data:`MAX_ROWS` rows, where its output equals oneDNN's bit
for bit (see :class:`AmxLinear`); the op itself takes any row count (tests/kernels/test_amx_linear.py checks both
paths against float64 and oneDNN; benchmarks/cpu_kernels.py times it against oneDNN at 1-512 rows).

The weight can also be held in its lossless 12-bit form (``pack_lossless``: kernels/bf16_codec.py): up to 32 rows
the kernel decodes a column block's next tile while AMX multiplies the current one (``coded_tiles``), above it
decodes whole blocks first; the products are those over the plain tiles, bit for bit.

``linear_blocks`` takes only some column blocks of a plain-tiles weight, read in place (the greedy head's candidate
blocks, kernels/greedy_head_cpu.py): the same columns the full product gives, bit for bit.

Built on first use (kernels/cpp_build.py) where the CPU has AMX-BF16 and the OS grants it; elsewhere, on a build
failure or with ``PDSERVE_CPU_AMX_LINEAR=0``, bf16 linears stay on oneDNN's packed kernel.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pdserve.kernels import cpp_build
from pdserve.kernels.bf16_codec import CODEC
from pdserve.kernels.cpu_simd import AMX_HELPERS, TRANSPOSE16
from pdserve.kernels.packed_linear import PackedLinear

log = logging.getLogger(__name__)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PD_AMX 1
#endif

namespace {
#ifdef PD_AMX
""" + AMX_HELPERS + TRANSPOSE16 + CODEC + r"""

// C tiles 0..MT-1 += A rows (16 per tile, lda elements apart) x one column block's B tiles, over kb K-blocks of 32.
template <int MT>
void tiles(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t kb, float* c) {
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t k = 0; k < kb; k++) {
    const uint16_t* ak = a + k * 32;
    _mm_prefetch((const char*)(b + (k + 4) * 512), _MM_HINT_T0);
    _tile_loadd(5, b + k * 512, 64);
    _tile_loadd(4, ak, lda * 2);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (MT > 1) { _tile_loadd(6, ak + 16 * lda, lda * 2); _tile_dpbf16ps(1, 6, 5); }
    if constexpr (MT > 2) { _tile_loadd(4, ak + 32 * lda, lda * 2); _tile_dpbf16ps(2, 4, 5); }
    if constexpr (MT > 3) { _tile_loadd(6, ak + 48 * lda, lda * 2); _tile_dpbf16ps(3, 6, 5); }
  }
  _tile_stored(0, c, 64);
  if constexpr (MT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, c + 768, 64);
}

// 17 or more rows: C tiles (rows 0-15, 16-31) x (column blocks b0, b1) += 32 rows of A x two column blocks' B tiles, so
// each K step loads four tiles for four products (tiles<2> per column block: six loads). Tile registers are not
// renamed, so a load waits for the products that read its register: each next K step's load is issued right after
// the last product that reads its register, and the next step's B tiles (past the last one: the next pair's, which
// follows in memory) are prefetched a step ahead, so their reads from memory overlap this step's products.
void tiles22(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t kb, float* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a, lda * 2);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_loadd(5, a + 16 * lda, lda * 2);
  for (int64_t k = 0; k < kb; k++) {
    const int64_t n = k + 1 < kb ? k + 1 : 2 * kb;   // the B tiles' next K step (or the next pair's first)
    for (int l = 0; l < 16; l++) {
      _mm_prefetch((const char*)(b0 + n * 512 + l * 32), _MM_HINT_T0);
      _mm_prefetch((const char*)(b1 + n * 512 + l * 32), _MM_HINT_T0);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (k + 1 == kb) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); break; }
    _tile_loadd(4, a + (k + 1) * 32, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(6, b0 + (k + 1) * 512, 64);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(7, b1 + (k + 1) * 512, 64);
    _tile_loadd(5, a + 16 * lda + (k + 1) * 32, lda * 2);
  }
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}

// tiles22 for one column block (an odd one left over), on tiles22's tile numbers: C tiles 0 (rows 0-15), 2 (16-31).
void tiles21(const uint16_t* a, int64_t lda, const uint16_t* b0, int64_t kb, float* c) {
  _tile_zero(0); _tile_zero(2);
  for (int64_t k = 0; k < kb; k++) {
    _tile_loadd(4, a + k * 32, lda * 2);
    _tile_loadd(6, b0 + k * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + 16 * lda + k * 32, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
  }
  _tile_stored(0, c, 64); _tile_stored(2, c + 512, 64);
}

// Coded weights (kernels/bf16_codec.py), up to 32 rows: C tiles 0 (rows 0-15), 2 (16-31) of block 0 and 1, 3 of
// block 1 (NB = 2) += A rows (tiles 4, 5) x each block's B tile (6, 7). Each K step decodes the blocks' next tiles
// into a two-step ring while AMX multiplies the current ones, and asks for the coded tiles three steps ahead.
template <int NB, bool TWO>
void coded_tiles(const uint16_t* a, int64_t lda, CodedBlock* cb, int64_t kb, float* c) {
  alignas(64) uint16_t ring[2][NB][512];
  for (int n = 0; n < NB; n++) decode_tile(cb[n], 0, ring[0][n]);
  _tile_zero(0); _tile_zero(2);
  if constexpr (NB == 2) { _tile_zero(1); _tile_zero(3); }
  for (int64_t k = 0; k < kb; k++) {
    _tile_loadd(6, ring[k & 1][0], 64);
    if constexpr (NB == 2) _tile_loadd(7, ring[k & 1][1], 64);
    _tile_loadd(4, a + k * 32, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a + 16 * lda + k * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if (k + 1 < kb)
      for (int n = 0; n < NB; n++) {
        const char* ahead = (const char*)(cb[n].tiles + (k + 4) * kCodedTile);
        for (int l = 0; l < kCodedTile / 64; l++) _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
        decode_tile(cb[n], k + 1, ring[(k + 1) & 1][n]);
      }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (TWO) { _tile_stored(2, c + 512, 64); if constexpr (NB == 2) _tile_stored(3, c + 768, 64); }
}
#endif

bool available() {
#ifdef PD_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// (N, K) bf16 -> (N/16, K/32, 16, 32) bf16, zero-padded: tile row r of a K-block holds, for each of the block's 16
// columns n, the pair (w[n][k0 + 2r], w[n][k0 + 2r + 1]). Seen as 32-bit pairs, a whole tile is the transpose of
// its 16 columns' 16 pairs: one register transpose (an element at a time, packing the model took 2.8x as long).
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w: bf16 (N, K)");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), nb = (N + 15) / 16, kb = (K + 31) / 32;
  at::Tensor out = at::zeros({nb, kb, 16, 32}, w.options());
  const uint16_t* src = (const uint16_t*)wc.data_ptr();
  uint16_t* dst = (uint16_t*)out.data_ptr();
  at::parallel_for(0, nb, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
      for (int64_t b = 0; b < kb; b++) {
        uint16_t* tile = dst + (j * kb + b) * 512;
#ifdef PD_AMX
        if (j * 16 + 16 <= N && b * 32 + 32 <= K) {
          __m512i r[16];
          for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(src + (j * 16 + n) * K + b * 32);
          transpose16(r);
          for (int p = 0; p < 16; p++) _mm512_store_si512(tile + p * 32, r[p]);
          continue;
        }
#endif
        for (int64_t n = j * 16; n < std::min(N, j * 16 + 16); n++)   // a partial tile (its rest stays zero)
          for (int64_t k = b * 32; k < std::min(K, b * 32 + 32); k++)
            tile[(k % 32) / 2 * 32 + (n % 16) * 2 + k % 2] = src[n * K + k];
      }
  });
  return out;
}

// (N, K) bf16 -> its packed tiles in the lossless coded form (kernels/bf16_codec.py): codes (N/16, K/32, 768) uint8
// and meta int32 (the blocks' tables, where their exceptions start, the exceptions)
std::tuple<at::Tensor, at::Tensor> pack_lossless(const at::Tensor& w) {
  const at::Tensor p = pack(w);
  const int64_t nb = p.size(0), kb = p.size(1);
  TORCH_CHECK(kb * 512 < (int64_t(1) << 23), "w: K too large for the coded form's exception indices");
  at::Tensor codes = at::empty({nb, kb, 768}, w.options().dtype(at::kByte));
  std::vector<std::vector<int32_t>> exc(nb);
  std::vector<uint8_t> tables(nb * 16);
#ifdef PD_AMX
  at::parallel_for(0, nb, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++)
      encode_block((const uint16_t*)p.data_ptr() + j * kb * 512, kb, codes.data_ptr<uint8_t>() + j * kb * 768,
                   tables.data() + 16 * j, exc[j]);
  });
#endif
  int64_t at_ = 5 * nb + 1;
  for (const auto& e : exc) at_ += e.size();
  TORCH_CHECK(at_ < (int64_t(1) << 31), "w: too many exceptions for int32 offsets");
  at::Tensor meta = at::empty({at_}, w.options().dtype(at::kInt));
  int32_t* m = meta.data_ptr<int32_t>();
  std::memcpy(m, tables.data(), tables.size());
  at_ = 5 * nb + 1;
  for (int64_t j = 0; j < nb; j++) {
    m[4 * nb + j] = int32_t(at_);
    std::copy(exc[j].begin(), exc[j].end(), m + at_);
    at_ += exc[j].size();
  }
  m[5 * nb] = int32_t(at_);
  return {codes, meta};
}

// Checks a coded weight (from pack_lossless) against its shape, so that decoding never reads or writes outside it.
void check_coded(const at::Tensor& codes, const at::Tensor& meta) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(2) == 768,
              "wp: a coded weight (N/16, K/32, 768) uint8");
  const int64_t nb = codes.size(0), kb = codes.size(1), E = meta.numel();
  TORCH_CHECK(meta.dim() == 1 && meta.scalar_type() == at::kInt && meta.is_contiguous() && E >= 5 * nb + 1,
              "meta: the coded weight's int32 tables, offsets and exceptions");
  const int32_t* m = meta.data_ptr<int32_t>();
  TORCH_CHECK(m[4 * nb] == 5 * nb + 1 && m[5 * nb] == E, "meta: exception offsets outside it");
  for (int64_t j = 0; j < nb; j++) {
    TORCH_CHECK(m[4 * nb + j] <= m[4 * nb + j + 1], "meta: exception offsets out of order");
    for (int32_t e = m[4 * nb + j], last = -1; e < m[4 * nb + j + 1]; last = m[e] >> 8, e++)
      TORCH_CHECK(m[e] >= 0 && (m[e] >> 8) > last && (m[e] >> 8) < kb * 512,
                  "meta: an exception outside its block or out of order");
  }
}

// The coded weight back to pack's tiles (N/16, K/32, 16, 32) bf16.
at::Tensor unpack_lossless(const at::Tensor& codes, const at::Tensor& meta) {
  check_coded(codes, meta);
  const int64_t nb = codes.size(0), kb = codes.size(1);
  at::Tensor out = at::empty({nb, kb, 16, 32}, codes.options().dtype(at::kBFloat16));
#ifdef PD_AMX
  at::parallel_for(0, nb, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; j++) {
      CodedBlock cb = coded_block(codes.data_ptr<uint8_t>(), meta.data_ptr<int32_t>(), nb, kb, j);
      for (int64_t k = 0; k < kb; k++) decode_tile(cb, k, (uint16_t*)out.data_ptr() + (j * kb + k) * 512);
    }
  });
#endif
  return out;
}

// x (M, K) @ w.T (+ bias) -> (M, N) bf16; w as pack's tiles, or (meta given) pack_lossless's codes. With blocks (int64,
// plain tiles), output column block j is the weight's column block blocks[j] (N = 16 * len(blocks)).
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N,
                       const c10::optional<at::Tensor>& meta, const at::Tensor* blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 (M, K)");
  if (meta.has_value())
    check_coded(wp, *meta);
  else
    TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.size(2) == 16 &&
                wp.size(3) == 32, "wp: a packed weight (N/16, K/32, 16, 32)");
  const int64_t* bmap = nullptr;
  if (blocks) {
    TORCH_CHECK(!meta.has_value() && blocks->dim() == 1 && blocks->scalar_type() == at::kLong && blocks->is_contiguous(),
                "blocks: int64 (B,), of plain tiles");
    bmap = blocks->data_ptr<int64_t>();
    for (int64_t i = 0; i < blocks->numel(); i++)
      TORCH_CHECK(bmap[i] >= 0 && bmap[i] < wp.size(0), "blocks: a block outside wp");
  }
  const int64_t M = x.size(0), K = x.size(1), nb = blocks ? blocks->numel() : wp.size(0), kb = wp.size(1);
  TORCH_CHECK(kb == (K + 31) / 32 && nb == (N + 15) / 16, "x: K of the packed weight; N: its rows");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias: (N,)");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || nb == 0) return out;
#ifdef PD_AMX
  const int64_t Mp = (M + 15) / 16 * 16, Kp = kb * 32;
  const uint16_t* a = (const uint16_t*)x.data_ptr();
  // Up to 32 rows of whole K blocks are read in place: the last row tile is configured with the rows it has (tail),
  // so no load reads past them and the rows need no padded copy.
  const int tail = Mp <= 32 && Kp == K && x.is_contiguous() ? int(M % 16) : 0;
  if (!tail && (Mp != M || Kp != K || !x.is_contiguous())) {  // zero-padded rows and K: whole tiles, no reads past the end
    // into this thread's scratch, kept between calls: a fresh buffer a call (plus aten's zeros + copy_) cost 10-50 us
    // of page faults and dispatch per linear at decode's 17-31 rows (benchmarks/cpu_kernels.py --compare-linear)
    static thread_local std::vector<uint16_t> scratch;
    scratch.resize(Mp * Kp);
    uint16_t* dst = scratch.data();
    const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
    const uint16_t* src = (const uint16_t*)xs.data_ptr();
    for (int64_t m = 0; m < M; m++) {
      std::memcpy(dst + m * Kp, src + m * xs.stride(0), K * sizeof(uint16_t));
      std::memset(dst + m * Kp + K, 0, (Kp - K) * sizeof(uint16_t));
    }
    std::memset(dst + M * Kp, 0, (Mp - M) * Kp * sizeof(uint16_t));
    a = dst;
  }
  const uint8_t* codes = meta.has_value() ? wp.data_ptr<uint8_t>() : nullptr;
  const int32_t* mp = meta.has_value() ? meta->data_ptr<int32_t>() : nullptr;
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  uint16_t* o = (uint16_t*)out.data_ptr();
  // Rows r of tile c (16 x 16 floats) plus the bias, rounded to bf16, into rows m0.. of column block j.
  auto store = [&](const float* c, int64_t m0, int64_t j) {
    const int64_t n0 = j * 16, cols = std::min<int64_t>(16, N - n0);
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bp ? _mm512_maskz_loadu_ps(keep, bp + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < 16 && m0 + r < M; r++) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + r * 16), bv));
      _mm256_mask_storeu_epi16(o + (m0 + r) * N + n0, keep, h);
    }
  };
  // From 17 rows each thread first takes a contiguous share of 3/4 of the column blocks, then the rest two at a time
  // as it gets free: on equal shares the two threads of an engine step finished 5-15% apart, one of them idle
  // meanwhile. Up to 16 rows (one stream per thread, at the memory's speed) each takes an equal range. Which thread
  // computes a block changes none of its sums.
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), nb);
  const bool steal = Mp >= 32;
  const int64_t share = steal ? nb * 3 / 4 / nt / 2 * 2 : 0;
  std::atomic<int64_t> next{steal ? share * nt : nb};
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    // the last row tile's C and A tiles: tiles<1>'s (and coded_tiles' second block's), or (17-31 rows) tiles22's and
    // tiles21's
    Tiles amx = !tail ? Tiles() : Mp == 16 ? Tiles(1u << 0 | 1u << 1 | 1u << 4, tail)
                                           : Tiles(1u << 2 | 1u << 3 | 1u << 5, tail);
    alignas(64) float c[4 * 256];
    static thread_local std::vector<uint16_t> decoded;   // coded weights over 32 rows: a block pair decoded whole
    auto block = [&](int64_t j, int64_t slot) -> const uint16_t* {   // column block j's tiles
      if (!codes) return (const uint16_t*)wp.data_ptr() + (bmap ? bmap[j] : j) * kb * 512;
      decoded.resize(2 * kb * 512);
      CodedBlock cb = coded_block(codes, mp, nb, kb, j);
      for (int64_t k = 0; k < kb; k++) decode_tile(cb, k, decoded.data() + (slot * kb + k) * 512);
      return decoded.data() + slot * kb * 512;
    };
    auto coded = [&](const int64_t j0, const int64_t j1) {   // coded weights, up to 32 rows: decoded as streamed
      int64_t j = j0;
      for (; j + 1 < j1; j += 2) {
        CodedBlock cb[2] = {coded_block(codes, mp, nb, kb, j), coded_block(codes, mp, nb, kb, j + 1)};
        if (Mp == 32) { coded_tiles<2, true>(a, Kp, cb, kb, c); store(c + 512, 16, j); store(c + 768, 16, j + 1); }
        else coded_tiles<2, false>(a, Kp, cb, kb, c);
        store(c, 0, j); store(c + 256, 0, j + 1);
      }
      for (; j < j1; j++) {
        CodedBlock cb[1] = {coded_block(codes, mp, nb, kb, j)};
        if (Mp == 32) { coded_tiles<1, true>(a, Kp, cb, kb, c); store(c + 512, 16, j); }
        else coded_tiles<1, false>(a, Kp, cb, kb, c);
        store(c, 0, j);
      }
    };
    auto run = [&](const int64_t j0, const int64_t j1) {   // column blocks [j0, j1)
      if (codes && Mp <= 32) return coded(j0, j1);
      int64_t j = j0;
      if (Mp >= 32)   // each column block pair is read from L1/L2 once per 32 rows
        for (; j + 1 < j1; j += 2) {
          const uint16_t *b0 = block(j, 0), *b1 = block(j + 1, 1);
          for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
            if (Mp - m0 < 32) {
              tiles<1>(a + m0 * Kp, Kp, b0, kb, c);
              tiles<1>(a + m0 * Kp, Kp, b1, kb, c + 256);
              store(c, m0, j); store(c + 256, m0, j + 1);
              continue;
            }
            tiles22(a + m0 * Kp, Kp, b0, b1, kb, c);
            store(c, m0, j); store(c + 256, m0, j + 1); store(c + 512, m0 + 16, j); store(c + 768, m0 + 16, j + 1);
          }
        }
      if (Mp == 32)
        for (; j < j1; j++) { tiles21(a, Kp, block(j, 0), kb, c); store(c, 0, j); store(c + 512, 16, j); }
      for (; j < j1; j++) {   // few rows: each column block is streamed from memory once
        const uint16_t* bj = block(j, 0);
        for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
          const int64_t mt = std::min<int64_t>(4, (Mp - m0) / 16);
          const uint16_t* am = a + m0 * Kp;
          switch (mt) {
            case 1: tiles<1>(am, Kp, bj, kb, c); break;
            case 2: tiles<2>(am, Kp, bj, kb, c); break;
            case 3: tiles<3>(am, Kp, bj, kb, c); break;
            default: tiles<4>(am, Kp, bj, kb, c); break;
          }
          for (int64_t i = 0; i < mt; i++) store(c + i * 256, m0 + 16 * i, j);
        }
      }
    };
    for (int64_t t = t0; t < t1; t++)
      if (steal) run(t * share, (t + 1) * share); else run(nb * t / nt, nb * (t + 1) / nt);
    for (int64_t j; (j = next.fetch_add(2, std::memory_order_relaxed)) < nb;) run(j, std::min<int64_t>(nb, j + 2));
  });
#else
  TORCH_CHECK(false, "built without AMX");
#endif
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias, int64_t N,
                  const c10::optional<at::Tensor>& meta) {
  return linear_impl(x, wp, bias, N, meta, nullptr);
}

// x (M, K) @ the packed weight's column blocks ``blocks`` (int64, each 16 columns) .T -> (M, 16 * len(blocks)) bf16,
// read in place: the columns linear gives for them, bit for bit (the greedy head's candidate blocks).
at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& blocks) {
  return linear_impl(x, wp, c10::nullopt, 16 * blocks.numel(), c10::nullopt, &blocks);
}
}  // namespace

TORCH_LIBRARY(pdserve_amx_linear, m) {
  m.def("available() -> bool");
  m.def("pack(Tensor w) -> Tensor");
  m.def("pack_lossless(Tensor w) -> (Tensor, Tensor)");
  m.def("unpack_lossless(Tensor codes, Tensor meta) -> Tensor");
  m.def("linear(Tensor x, Tensor wp, Tensor? bias, int n, Tensor? meta=None) -> Tensor");
  m.def("linear_blocks(Tensor x, Tensor wp, Tensor blocks) -> Tensor");
  m.impl("available", available);
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.impl("pack_lossless", c10::DispatchKey::CPU, TORCH_FN(pack_lossless));
  m.impl("unpack_lossless", c10::DispatchKey::CPU, TORCH_FN(unpack_lossless));
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.impl("linear_blocks", c10::DispatchKey::CPU, TORCH_FN(linear_blocks));
}
"""


NEEDS = ("avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")   # CPU flags it is compiled for


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the kernel; None when it works, else why it cannot be used."""
    reason = cpp_build.build_for("pdserve_amx_linear", SOURCE, NEEDS, "the AMX linear kernel")
    if reason:
        log.warning("%s; bf16 linears stay on oneDNN", reason)
    return reason


MAX_ROWS = 32   # up to here its output equals oneDNN's bit for bit; above, oneDNN's blocking sums in another order


class AmxLinear(nn.Module):
    """``x (..., K) -> x @ w.T + b (..., N)`` in bf16: up to :data:`MAX_ROWS` rows (decode) on this kernel, more
    (prefill) on oneDNN's packed kernel. ``w`` is held in both packed layouts (attributes, not parameters: they never
    enter a state dict or a device move): the kernel's as ``packed`` tiles, or with ``lossless`` (the default unless
    ``PDSERVE_CPU_AMX_LOSSLESS=0``) as ``codes`` and ``meta``, their lossless 12-bit form (kernels/bf16_codec.py),
    3/4 of the bytes and the same outputs. So dense weights take 1.75-2x their size in memory.

    Why not this kernel for every row count: it is as fast as oneDNN from 128 rows on, but above 32 rows oneDNN's
    blocking changes its summation order and this kernel's does not, and the ~1e-4 of outputs that then round 1 bf16
    ulp apart moved the bf16 engine's teacher-forced agreement with transformers bf16 from 0.992 to 0.984
    (tests/runtime/test_dtype_default.py). Up to 32 rows the two are bit-equal, so nothing changes but speed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lossless: bool | None = None) -> None:
        from pdserve.runtime import envs

        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = self.codes = self.meta = None
        if envs.cpu_amx_lossless() if lossless is None else lossless:
            self.codes, self.meta = torch.ops.pdserve_amx_linear.pack_lossless(weight.detach())
        else:
            self.packed = torch.ops.pdserve_amx_linear.pack(weight.detach())
        self.onednn = PackedLinear(weight, bias)
        self.opaque_weight_bytes = sum(t.nbytes for t in (self.packed, self.codes, self.meta) if t is not None)
        self.bias = self.onednn.bias

    @property
    def kernel_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the kernel's ``linear`` op takes as (``wp``, ``meta``): the tiles and None, or the codes and meta."""
        return (self.packed, None) if self.packed is not None else (self.codes, self.meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS:
            return self.onednn(x)
        wp, meta = self.kernel_weight
        out = torch.ops.pdserve_amx_linear.linear(rows, wp, self.bias, self.out_features, meta)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"lossless={self.codes is not None}")
