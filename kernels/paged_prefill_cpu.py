"""Paged prefill attention on CPU (bf16 cache, AMX): a torch C++ extension, flash-style, K/V read in place.

Every prefill chunk of a step in one call: sequence ``s``'s ``q_len`` new queries (rows ``q0 .. q0 + q_len`` of
``q (T, H, D)``) attend causally over the first ``seq_len`` slots its block table names in one layer of the block-major
cache ``kv_layer (num_blocks, 2, block_size, Hkv, D)``, query ``i`` sitting at position ``seq_len - q_len + i`` (so a
chunk that continues a cached prefix needs no mask tensor and no gathered copy of the context).

How: the step's tiles of 16 query rows (the G heads of a KV head share its K/V, so a tile spans heads and
positions) are split into contiguous runs of equal cost, one per thread. A thread takes its run one (sequence, KV
head) at a time: it repacks the K/V chunks its tiles there reach into the pair-interleaved layout AMX's ``tdpbf16ps``
takes (zero-padded to 64 keys; K by 16 x 16-word register transposes, V by interleaving rows in pairs), into a buffer
of its own that stays in its core's cache, then runs those tiles: an online softmax over 64-key chunks, S = Q K^T on
AMX tiles, the float32 softmax on AVX-512 (the 16 rows' maxima and sums reduced together through a transpose; masks
only at the diagonal), P (rounded to bf16, as torch's bf16 SDPA does) times V on AMX tiles, float32 sums rescaled per
chunk; chunks past a tile's last position are skipped. Each thread puts back the tile configuration it found
(oneDNN's GEMMs use AMX too).

Why: torch's CPU SDPA ran these shapes (head_dim 64, GQA, a few hundred tokens) at 30-120 GFLOP/s, and a chunk that
continues a cached prefix also paid a gathered copy of its context and a mask tensor per layer; prefill attention was
the largest cost of the mixed serving workload after the linears. AVX512-BF16's ``vdpbf16ps`` was tried first: it
issues at a quarter of the FMA rate on this CPU (45 GFLOP/s a core), slower than SDPA; one AMX tile product is ~870.
tests/kernels/test_paged_prefill_cpu.py checks it against float64 and torch's bf16 SDPA.

Built on first use (kernels/cpp_build.py) where the CPU has AMX-BF16 and the OS grants it, for head_dim 64; elsewhere,
on a build failure or with ``PDSERVE_CPU_PREFILL_ATTENTION=torch``, prefills run torch's SDPA (kernels/torch_ref.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build, paged_prefill_f32_cpu
from pdserve.kernels.cpu_simd import AMX_HELPERS, AVX512_HELPERS, TRANSPOSE16

log = logging.getLogger(__name__)
NEEDS = ("avx512_bf16", "amx_tile", "amx_bf16")   # the CPU flags it is built with (and needs)

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PD_AVX512 1
#endif

namespace {
#ifdef PD_AVX512
""" + AVX512_HELPERS + AMX_HELPERS + TRANSPOSE16 + r"""

struct Seq { int64_t q0, q_len, len; const int64_t* table; uint32_t* k; uint32_t* v; };  // k, v: its packed K/V
struct Args { const uint16_t* q; uint16_t* out; const uint16_t* kv; int64_t H, Hkv, G, bs, s_block, s_kv, s_q; float scale; };

// a * b rounded: an op g++ does not contract with a following add into an FMA (it does with _mm512_mul_ps's).
inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

inline int64_t chunks(int64_t len) { return (len + 63) / 64; }

// One 64-key chunk ``c`` of a (sequence, KV head)'s K and V, zero past its length, in the layouts vdpbf16ps pairs:
// K as [key tile of 16][dim pair p][key] words (k[2p], k[2p+1]), each tile a 16 x 16 word transpose of its keys' rows
// (twice: pairs 0-15, 16-31); V as [key pair w][dim] words (v_2w[d], v_2w+1[d]), two rows interleaved per pair.
template <int D>
void pack(const Args& a, const Seq& s, int64_t kh, int64_t c) {
  static_assert(D == 64, "rows of two 32-dim halves");
  const uint16_t* rows[64];  // this chunk's K rows; null past the sequence's length
  for (int t = 0; t < 64; t++) {
    const int64_t key = c * 64 + t;
    rows[t] = key < s.len ? a.kv + s.table[key / a.bs] * a.s_block + (key % a.bs) * a.Hkv * D + kh * D : nullptr;
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int kt = 0; kt < 4; kt++)
    for (int h = 0; h < 2; h++) {
      __m512i r[16];
      for (int t = 0; t < 16; t++) { const uint16_t* k = rows[kt * 16 + t]; r[t] = k ? _mm512_loadu_si512(k + 32 * h) : zero; }
      transpose16(r);
      uint32_t* out = s.k + (c * 4 + kt) * (D / 2) * 16 + h * 16 * 16;
      for (int p = 0; p < 16; p++) _mm512_store_si512(out + p * 16, r[p]);
    }
  __m512i lo, hi;  // word 2i of a pair's output: dim i (+16) of its first key, word 2i + 1: of its second
  {
    alignas(64) uint16_t il[32], ih[32];
    for (int i = 0; i < 16; i++) { il[2 * i] = i; il[2 * i + 1] = 32 + i; ih[2 * i] = 16 + i; ih[2 * i + 1] = 48 + i; }
    lo = _mm512_load_si512(il); hi = _mm512_load_si512(ih);
  }
  for (int w = 0; w < 32; w++) {
    const uint16_t *k0 = rows[2 * w], *k1 = rows[2 * w + 1];
    uint32_t* out = s.v + (c * 32 + w) * D;
    for (int h = 0; h < 2; h++) {
      const __m512i x = k0 ? _mm512_loadu_si512(k0 + a.s_kv + 32 * h) : zero;
      const __m512i y = k1 ? _mm512_loadu_si512(k1 + a.s_kv + 32 * h) : zero;
      _mm512_store_si512(out + 32 * h, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_store_si512(out + 32 * h + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// One thread's scratch: the tile's query rows, a chunk's scores (then its P @ V), bf16 probabilities, the output sums.
struct Scratch {
  alignas(64) uint16_t q[16][64];
  alignas(64) float sc[16][64];
  alignas(64) uint32_t p[16][32];
  alignas(64) float o[16][64];
};

// 16 query rows of one (sequence, KV head), head_dim 64: rows f0 .. f0 + 16 of its (query, head-in-group) pairs
// (f = i * G + g); rows past the end repeat the last one and are not stored. Per 64-key chunk: S = Q K^T on AMX
// (tmm0-1 Q, tmm2-5 S, tmm6-7 K), the online softmax on AVX-512, then P V on AMX (tmm0-1 P, tmm2-5 P V, tmm6-7 V).
void tile(const Args& a, const Seq& s, int64_t kh, int64_t f0, Scratch& w) {
  constexpr int D = 64;
  const int64_t nf = s.q_len * a.G;
  int64_t pos[16];
  alignas(64) float m[16], alpha[16];  // per row: the running max of the scaled scores, this chunk's rescale
  __m512 vm = _mm512_set1_ps(-INFINITY), vl = _mm512_setzero_ps();  // lane r: row r's running max and sum
  for (int r = 0; r < 16; r++) {
    const int64_t f = std::min(f0 + r, nf - 1), i = f / a.G, g = f % a.G;
    std::memcpy(w.q[r], a.q + (s.q0 + i) * a.s_q + (kh * a.G + g) * D, D * 2);
    pos[r] = s.len - s.q_len + i;  // non-decreasing in r
    for (int j = 0; j < D / 16; j++) _mm512_store_ps(w.o[r] + 16 * j, _mm512_setzero_ps());
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int64_t nc = pos[15] / 64 + 1;
  for (int64_t c = 0; c < nc; c++) {
    const uint32_t* kc = s.k + c * 64 * (D / 2);   // key tile j, dims 32h..: kc + (j * 32 + 16 * h) * 16 words
    _tile_loadd(0, w.q[0], D * 2);
    _tile_loadd(1, w.q[0] + 32, D * 2);
    _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
#define PD_QK(j, t) _tile_loadd(6, kc + (j * 32) * 16, 64); _tile_loadd(7, kc + (j * 32 + 16) * 16, 64); \
    _tile_dpbf16ps(t, 0, 6); _tile_dpbf16ps(t, 1, 7);
    PD_QK(0, 2) PD_QK(1, 3) PD_QK(2, 4) PD_QK(3, 5)  // tile numbers: literals (the intrinsics paste them)
#undef PD_QK
    _tile_stored(2, w.sc[0], 256); _tile_stored(3, w.sc[0] + 16, 256);
    _tile_stored(4, w.sc[0] + 32, 256); _tile_stored(5, w.sc[0] + 48, 256);
    // The online softmax, its row reductions done 16 rows at a time (a transpose, then lane-wise max / sum). Keys past
    // a row's position score -inf (only the chunks at the diagonal have any). Every value is the one a row at a time
    // gives (scale, then subtract; scalar exp for the rescale; the sum in _mm512_reduce_add_ps's pairing), so the
    // kernel's output does not depend on how its rows are reduced.
    const bool full = c * 64 + 63 <= pos[0];
    __m512i red[16];
    for (int r = 0; r < 16; r++) {
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < 4; j++) {
        __m512 x = _mm512_load_ps(w.sc[r] + 16 * j);
        if (!full) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int(c * 64 + j * 16)));
          x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(int(pos[r]))), x);
          _mm512_store_ps(w.sc[r] + 16 * j, x);
        }
        mx = _mm512_max_ps(mx, x);
      }
      red[r] = _mm512_castps_si512(mx);
    }
    transpose16(red);
    __m512 cm = _mm512_castsi512_ps(red[0]);
    for (int j = 1; j < 16; j++) cm = _mm512_max_ps(cm, _mm512_castsi512_ps(red[j]));
    const __m512 m_new = _mm512_max_ps(vm, _mm512_mul_ps(cm, scale));  // scale > 0: the max of the scaled scores
    // alpha = e^(old max - new max): 1 where the max stayed (most chunks), 0 on the first; scalar expf where it moved
    alignas(64) float m_old[16];
    _mm512_store_ps(m_old, vm);
    _mm512_store_ps(m, m_new);
    const __mmask16 stayed = _mm512_cmp_ps_mask(vm, m_new, _CMP_EQ_OQ);
    _mm512_store_ps(alpha, _mm512_maskz_mov_ps(stayed, _mm512_set1_ps(1.f)));
    for (uint32_t moved = ~stayed & _mm512_cmp_ps_mask(vm, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); moved;
         moved &= moved - 1) {
      const int r = __builtin_ctz(moved);
      alpha[r] = std::exp(m_old[r] - m[r]);
    }
    vm = m_new;
    for (int r = 0; r < 16; r++) {
      const __m512 mr = _mm512_set1_ps(m[r]);
      __m512 x[4];
      for (int j = 0; j < 4; j++) x[j] = exp16(_mm512_sub_ps(mul(_mm512_load_ps(w.sc[r] + 16 * j), scale), mr));
      red[r] = _mm512_castps_si512(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(x[0], x[1]), x[2]), x[3]));
      _mm512_store_si512(w.p[r], (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
      _mm512_store_si512(w.p[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
    }
    transpose16(red);   // lane j of every row in red[j]: summed in pairs (j, j + 8), (j, j + 4), (j, j + 2), (0, 1)
    for (int h = 8; h >= 1; h /= 2)
      for (int j = 0; j < h; j++)
        red[j] = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(red[j]), _mm512_castsi512_ps(red[j + h])));
    vl = _mm512_add_ps(mul(vl, _mm512_load_ps(alpha)), _mm512_castsi512_ps(red[0]));
    const uint32_t* vc = s.v + c * 32 * D;   // key pairs 16h.., dims 16j..: vc + 16 * h * D + 16 * j words
    _tile_loadd(0, w.p[0], 128);
    _tile_loadd(1, w.p[0] + 16, 128);
    _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
#define PD_PV(j, t) _tile_loadd(6, vc + 16 * j, D * 4); _tile_loadd(7, vc + 16 * D + 16 * j, D * 4); \
    _tile_dpbf16ps(t, 0, 6); _tile_dpbf16ps(t, 1, 7);
    PD_PV(0, 2) PD_PV(1, 3) PD_PV(2, 4) PD_PV(3, 5)
#undef PD_PV
    _tile_stored(2, w.sc[0], 256); _tile_stored(3, w.sc[0] + 16, 256);
    _tile_stored(4, w.sc[0] + 32, 256); _tile_stored(5, w.sc[0] + 48, 256);
    for (int r = 0; r < 16; r++) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < 4; j++)
        _mm512_store_ps(w.o[r] + 16 * j, _mm512_fmadd_ps(_mm512_load_ps(w.o[r] + 16 * j), al, _mm512_load_ps(w.sc[r] + 16 * j)));
    }
  }
  alignas(64) float inv_l[16];
  _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.f), vl));
  for (int r = 0; r < 16 && f0 + r < nf; r++) {
    const int64_t i = (f0 + r) / a.G, g = (f0 + r) % a.G;
    uint16_t* out = a.out + ((s.q0 + i) * a.H + kh * a.G + g) * D;
    const __m512 inv = _mm512_set1_ps(inv_l[r]);
    for (int j = 0; j < 4; j++)
      _mm256_storeu_si256((__m256i*)(out + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(w.o[r] + 16 * j), inv)));
  }
}

// The step's work: its tiles in (sequence, KV head) order, each costing the 64-key chunks it visits, and each pair's
// repacking (kPackCost tile chunks a chunk; 1, 2 and 4 timed alike). Each thread takes a contiguous run (the least
// maximum cost over at most nt runs) and, one pair at a time, repacks the chunks its tiles there reach into its own
// buffer (kept between calls, sized for one pair: 256 bytes a token), then runs those tiles; a pair split between two
// runs is repacked by both. So no core reads K/V another core repacked and there is no barrier: dealing chunks and
// tiles to the threads round-robin, with a barrier between, made 32 new tokens over 992 cached ~1.3x slower. A
// tile's arithmetic does not depend on its thread: the same bits either way (tests/kernels/test_paged_prefill_cpu.py).
constexpr int64_t kPackCost = 2;

void run(const Args& a, std::vector<Seq>& seqs) {
  constexpr int D = 64, R = 16;
  struct Work { int64_t pair, f0, nc; };   // pair = seq * Hkv + KV head; nc: the chunks its rows' positions reach
  std::vector<Work> work;
  std::vector<int64_t> cost{0};   // cost[i]: the cost of work[0 .. i), a pair's repacking counted at its first tile
  for (int64_t s = 0; s < (int64_t)seqs.size(); s++)
    for (int64_t kh = 0; kh < a.Hkv; kh++)
      for (int64_t f0 = 0; f0 < seqs[s].q_len * a.G; f0 += R) {
        const Seq& q = seqs[s];
        const int64_t last = std::min(f0 + R, q.q_len * a.G) - 1, nc = (q.len - q.q_len + last / a.G) / 64 + 1;
        work.push_back({s * a.Hkv + kh, f0, nc});
        cost.push_back(cost.back() + nc + (f0 == 0 ? kPackCost * chunks(q.len) : 0));
      }
  // Contiguous runs, none costing more than C (a run that starts inside a pair also repacks it), for the least C
  // that needs at most nt runs.
  const int64_t nt = at::get_num_threads();
  std::vector<size_t> first;   // run r is work[first[r] .. first[r + 1])
  auto split = [&](int64_t C) {
    first.assign(1, 0);
    while (first.back() < work.size() && (int64_t)first.size() <= nt) {
      const size_t i = first.back();
      const int64_t dup = work[i].f0 ? kPackCost * chunks(seqs[work[i].pair / a.Hkv].len) : 0;
      const size_t j = std::upper_bound(cost.begin() + i + 1, cost.end(), cost[i] + C - dup) - cost.begin() - 1;
      first.push_back(std::max(j, i + 1));
    }
    return first.back() == work.size();
  };
  int64_t lo = 1, hi = cost.back();
  while (lo < hi) {
    const int64_t C = (lo + hi) / 2;
    if (split(C)) hi = C; else lo = C + 1;
  }
  split(lo);
  const int64_t runs = (int64_t)first.size() - 1;
  at::parallel_for(0, runs, 1, [&](int64_t t0, int64_t t1) {
    FlushDenormals ftz;
    Tiles amx;
    Scratch w;
    static thread_local std::unique_ptr<uint32_t, decltype(&std::free)> buf(nullptr, &std::free);
    static thread_local int64_t words = 0;
    for (int64_t t = t0; t < t1; t++)
      for (size_t i = first[t]; i < first[t + 1];) {
        const int64_t pair = work[i].pair;
        size_t end = i;
        int64_t nc = 0;   // non-decreasing along a pair's tiles: the last one's
        for (; end < first[t + 1] && work[end].pair == pair; end++) nc = work[end].nc;
        Seq s = seqs[pair / a.Hkv];
        const int64_t n = chunks(s.len) * 32 * D;   // K and V: whole 64-key chunks of len * D / 2 words each
        if (2 * n > words) {   // grown, never shrunk (a failed allocation leaves the old buffer)
          uint32_t* grown = (uint32_t*)std::aligned_alloc(64, 2 * n * 4);   // whole cache lines
          TORCH_CHECK(grown, "out of memory for the packed K/V");
          buf.reset(grown);
          words = 2 * n;
        }
        s.k = buf.get(); s.v = buf.get() + n;
        for (int64_t c = 0; c < nc; c++) pack<D>(a, s, pair % a.Hkv, c);
        for (; i < end; i++) tile(a, s, pair % a.Hkv, work[i].f0, w);
      }
  });
}
#endif

bool available() {
#ifdef PD_AVX512
  return amx_permitted();
#else
  return false;
#endif
}

// q, out (T, H, D) bf16 (q: each row's H * D contiguous, e.g. a view of the fused q/k/v); info (S, 3) int64 rows
// (first row, q_len, seq_len); tables (S, nb) int64.
void prefill(const at::Tensor& q, at::Tensor out, const at::Tensor& kv_layer, const at::Tensor& tables,
             const at::Tensor& info, double scale) {
  TORCH_CHECK(available(), "the paged prefill kernel needs AMX-BF16 (built with it, granted by the kernel)");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: bf16 (T, H, D), each row's H * D contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(), "out: like q");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.scalar_type() == at::kBFloat16, "kv_layer: bf16 (num_blocks, 2, bs, Hkv, D)");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), bs = kv_layer.size(2), Hkv = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == D && kv_layer.stride(4) == 1 && kv_layer.stride(3) == D && kv_layer.stride(2) == Hkv * D,
              "kv_layer: head_dim of q, each block's (block_size, Hkv, D) contiguous");
  TORCH_CHECK(H % Hkv == 0, "q: heads a multiple of the KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables: contiguous int64 (S, nb)");
  TORCH_CHECK(info.dim() == 2 && info.size(1) == 3 && info.size(0) == tables.size(0) && info.scalar_type() == at::kLong &&
              info.is_contiguous(), "info: contiguous int64 (S, 3)");
  const int64_t S = info.size(0), nb = tables.size(1), num_blocks = kv_layer.size(0);
  const int64_t* ip = info.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  std::vector<Seq> seqs;
  for (int64_t s = 0; s < S; s++) {  // never read or write outside q, out or the cache
    const int64_t q0 = ip[3 * s], q_len = ip[3 * s + 1], len = ip[3 * s + 2];
    TORCH_CHECK(q0 >= 0 && q_len >= 1 && q0 + q_len <= T, "info: query rows outside q");
    TORCH_CHECK(len >= q_len && len <= nb * bs, "info: seq_len must be q_len..nb * block_size");
    for (int64_t b = 0; b < (len + bs - 1) / bs; b++)
      TORCH_CHECK(tp[s * nb + b] >= 0 && tp[s * nb + b] < num_blocks, "tables: block id out of range");
    seqs.push_back({q0, q_len, len, tp + s * nb, nullptr, nullptr});
  }
#ifdef PD_AVX512
  const Args a{(const uint16_t*)q.data_ptr(), (uint16_t*)out.data_ptr(), (const uint16_t*)kv_layer.data_ptr(),
               H, Hkv, H / Hkv, bs, kv_layer.stride(0), kv_layer.stride(1), q.stride(0), float(scale)};
  TORCH_CHECK(D == 64, "head_dim must be 64");
  run(a, seqs);
#endif
}
}  // namespace

TORCH_LIBRARY(pdserve_prefill_cpu, m) {
  m.def("available() -> bool", &available);
  m.def("prefill(Tensor q, Tensor(a!) out, Tensor kv_layer, Tensor tables, Tensor info, float scale) -> ()");
  m.impl("prefill", c10::DispatchKey::CPU, TORCH_FN(prefill));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the kernel; None when it works here, else why it cannot be used."""
    reason = cpp_build.build_for("pdserve_prefill_cpu", SOURCE, NEEDS, "the paged prefill attention kernel")
    if reason:
        log.warning("%s; CPU prefill attention uses torch's SDPA", reason)
    return reason


def enabled(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill attention on ``device`` over a ``dtype`` cache runs this kernel (bf16, head_dim 64, built) or
    its float32 twin (kernels/paged_prefill_f32_cpu.py), not switched off."""
    from pdserve.runtime import envs

    if device.type != "cpu" or envs.cpu_prefill_attention() != "paged":
        return False
    if dtype == torch.float32:
        return paged_prefill_f32_cpu.enabled(head_dim)
    return dtype == torch.bfloat16 and head_dim == 64 and load_extension() is None


def paged_prefill(q: torch.Tensor, out: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                  info: torch.Tensor, scale: float) -> None:
    """Writes the causal attention of each sequence's new queries into its rows of ``out``: q, out (T, H, D) bf16 (or
    float32: kernels/paged_prefill_f32_cpu.py), out contiguous, q read in place where each row's H * D is (the RoPE
    output's q view), else copied; ``info`` (S, 3) int64 rows (first row, q_len, seq_len); ``tables`` (S, nb) int64
    block ids."""
    f32 = q.dtype == torch.float32
    if reason := (paged_prefill_f32_cpu.load_extension() if f32 else load_extension()):
        raise RuntimeError(reason)
    if q.dim() == 3 and (q.stride(2) != 1 or q.stride(1) != q.shape[2]):
        q = q.contiguous()
    op = torch.ops.pdserve_prefill_f32_cpu.prefill if f32 else torch.ops.pdserve_prefill_cpu.prefill
    op(q, out, kv_layer, tables, info, scale)
