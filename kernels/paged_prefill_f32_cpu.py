"""Paged prefill attention on CPU over a float32 cache (AVX2 + FMA): kernels/paged_prefill_cpu.py's interface, K/V
read in place.

Every prefill chunk of a step in one call: sequence ``s``'s ``q_len`` new queries (rows ``q0 .. q0 + q_len`` of
``q (T, H, D)``) attend causally over the first ``seq_len`` slots its block table names in one layer of the block-major
cache ``kv_layer (num_blocks, 2, block_size, Hkv, D)``, query ``i`` at position ``seq_len - q_len + i``: no gathered
copy of the context and no mask tensor.

How: a work item is one (sequence, KV head, run of 16 query positions): its G x 16 query rows (the heads of the KV
head share its K/V), pre-scaled. It walks the keys up to its last position 16 at a time: the chunk's K transposed
into a (D, 16) buffer, S = Q K^T four rows at a time (two 8-lane accumulators a row, one broadcast of a query value
per dimension), the causal mask only where a row's position falls inside the chunk, an online softmax (float32,
the exp polynomial of the other CPU kernels, ~2e-7 relative), O += P V two rows and 32 dimensions at a time. The
items are split into contiguous runs of equal cost (positions x keys), one per thread.

Why: torch's CPU SDPA ran the serving workload's float32 prefills (head_dim 64, GQA 9/3, a few hundred tokens) at
~55 GFLOP/s, ~16% of a mixed step on a 2-core AMD EPYC (Zen 3); chunks that continue a context also paid a gathered
copy and a mask per layer. Numerics: float32 throughout, summed in another order than SDPA's (within ~1e-6);
tests/kernels/test_paged_prefill_f32_cpu.py checks it against float64 attention and the engine against transformers.

Built on first use where the CPU has AVX2 and FMA, head_dim a multiple of 32 (<= 256); elsewhere, on a build failure
or with ``PDSERVE_CPU_PREFILL_ATTENTION=torch``, prefills run torch's SDPA (kernels/torch_ref.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import cpp_build
from pdserve.kernels.cpu_simd import AVX2_HELPERS

log = logging.getLogger(__name__)
NEEDS = ("avx2", "fma")

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {
""" + AVX2_HELPERS + r"""

constexpr int64_t KC = 32;   // keys a chunk
constexpr int64_t QP = 16;   // query positions an item

struct Item { int64_t s, g, p0, p1; };

struct Args {
  const float* q; int64_t qs0, qs1;            // q rows: token stride, head stride (D floats contiguous)
  float* out; int64_t H, G, D;
  const float* kv; int64_t ks0, ks1, ks2, ks3;  // kv_layer strides: block, K/V, slot, head
  const int64_t* tables; int64_t nb, bs;
  const int64_t* info;
  float scale;
};

// A thread's K of one (sequence, KV head), transposed chunk by chunk: chunk c's (D, KC) block at kt + c * D * KC,
// key c * KC + k's value d at [d * KC + k] (an 8 KB block for D = 64: its rows share no L1 set, as rows a whole
// context apart would); zeros past the sequence's end; extended as later items reach further keys.
struct KCache {
  int64_t s = -1, g = -1, n = 0;
  std::vector<float> kt;
  const float* get(const Args& a, int64_t s_, int64_t g_, int64_t kend, int64_t seq_len) {
    if (s_ != s || g_ != g) { s = s_; g = g_; n = 0; }
    const int64_t need = (kend + KC - 1) / KC * KC;
    if ((int64_t)kt.size() < need * a.D) kt.resize((size_t)(std::max(need, (seq_len + KC - 1) / KC * KC) * a.D));
    const int64_t* table = a.tables + s * a.nb;
    for (; n < need; n++) {
      float* col = kt.data() + n / KC * a.D * KC + n % KC;
      if (n < seq_len) {
        const float* row = a.kv + table[n / a.bs] * a.ks0 + (n % a.bs) * a.ks2 + g * a.ks3;
        for (int64_t d = 0; d < a.D; d++) col[d * KC] = row[d];
      } else {
        for (int64_t d = 0; d < a.D; d++) col[d * KC] = 0.f;
      }
    }
    return kt.data();
  }
};

// One item: rows r = p * G + j (position p0 + p, head g * G + j) of sequence s.
void run_item(const Args& a, const Item& it, KCache& kc, float* Q, float* O, float* S, const float** vrow,
              float* m, float* l) {
  const int64_t D = a.D, G = a.G, np = it.p1 - it.p0, R = np * G;
  const int64_t q0 = a.info[3 * it.s], q_len = a.info[3 * it.s + 1], seq_len = a.info[3 * it.s + 2];
  const int64_t base = seq_len - q_len, kend = base + it.p1;   // keys the last position sees
  const __m256 sc = _mm256_set1_ps(a.scale);
  for (int64_t r = 0; r < R; r++) {
    const float* src = a.q + (q0 + it.p0 + r / G) * a.qs0 + (it.g * G + r % G) * a.qs1;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(Q + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), sc));
    std::fill(O + r * D, O + (r + 1) * D, 0.f);
    m[r] = -INFINITY; l[r] = 0.f;
  }
  const int64_t* table = a.tables + it.s * a.nb;
  const float* kt_all = kc.get(a, it.s, it.g, kend, seq_len);
  for (int64_t c0 = 0; c0 < kend; c0 += KC) {
    const int64_t nk = std::min(KC, kend - c0);
    const float* KT = kt_all + c0 * D;   // the chunk's (D, KC) block
    for (int64_t k = 0; k < nk; k++) {
      const int64_t slot = c0 + k;
      vrow[k] = a.kv + table[slot / a.bs] * a.ks0 + a.ks1 + (slot % a.bs) * a.ks2 + it.g * a.ks3;
    }
    // S = Q K^T, four rows x 16 keys at a time
    for (int64_t k0 = 0; k0 < KC; k0 += 16) {
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) {
        __m256 acc[4][2];
        for (auto& x : acc) x[0] = x[1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          const __m256 k0v = _mm256_loadu_ps(KT + d * KC + k0), k1v = _mm256_loadu_ps(KT + d * KC + k0 + 8);
          for (int i = 0; i < 4; i++) {
            const __m256 qv = _mm256_broadcast_ss(Q + (r + i) * D + d);
            acc[i][0] = _mm256_fmadd_ps(qv, k0v, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qv, k1v, acc[i][1]);
          }
        }
        for (int i = 0; i < 4; i++) {
          _mm256_storeu_ps(S + (r + i) * KC + k0, acc[i][0]);
          _mm256_storeu_ps(S + (r + i) * KC + k0 + 8, acc[i][1]);
        }
      }
      for (; r < R; r++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
          const __m256 qv = _mm256_broadcast_ss(Q + r * D + d);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(KT + d * KC + k0), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(KT + d * KC + k0 + 8), a1);
        }
        _mm256_storeu_ps(S + r * KC + k0, a0); _mm256_storeu_ps(S + r * KC + k0 + 8, a1);
      }
    }
    // online softmax: S becomes P (0 past a row's position and past the chunk), O rescaled
    for (int64_t r = 0; r < R; r++) {
      float* s = S + r * KC;
      const int64_t seen = std::min(nk, base + it.p0 + r / G - c0 + 1);   // keys of the chunk the row sees
      if (seen <= 0) { std::fill(s, s + KC, 0.f); continue; }
      for (int64_t k = seen; k < KC; k++) s[k] = -INFINITY;
      __m256 mv = _mm256_loadu_ps(s);
      for (int64_t k = 8; k < KC; k += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + k));
      const float mx = std::max(m[r], hmax8(mv));
      const float corr = std::exp(m[r] - mx);   // 0 for the first chunk (m = -inf)
      mv = _mm256_set1_ps(mx);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t k = 0; k < KC; k += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mv));
        _mm256_storeu_ps(s + k, p);
        sum = _mm256_add_ps(sum, p);
      }
      l[r] = l[r] * corr + hsum8(sum);
      m[r] = mx;
      if (corr != 1.f) {
        const __m256 cv = _mm256_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(O + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(O + r * D + d), cv));
      }
    }
    // O += P V: two rows x 32 dimensions at a time
    for (int64_t r = 0; r < R; r += 2) {
      const bool two = r + 1 < R;
      const float* p_a = S + r * KC;
      const float* p_b = S + (two ? r + 1 : r) * KC;
      for (int64_t d = 0; d < D; d += 32) {
        float* oa = O + r * D + d;
        float* ob = O + (two ? r + 1 : r) * D + d;
        __m256 x[4], y[4];
        for (int i = 0; i < 4; i++) { x[i] = _mm256_loadu_ps(oa + 8 * i); y[i] = _mm256_loadu_ps(ob + 8 * i); }
        for (int64_t k = 0; k < nk; k++) {
          const __m256 pa = _mm256_broadcast_ss(p_a + k), pb = _mm256_broadcast_ss(p_b + k);
          const float* v = vrow[k] + d;
          for (int i = 0; i < 4; i++) {
            const __m256 vv = _mm256_loadu_ps(v + 8 * i);
            x[i] = _mm256_fmadd_ps(pa, vv, x[i]);
            y[i] = _mm256_fmadd_ps(pb, vv, y[i]);
          }
        }
        for (int i = 0; i < 4; i++) {
          _mm256_storeu_ps(oa + 8 * i, x[i]);
          if (two) _mm256_storeu_ps(ob + 8 * i, y[i]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; r++) {
    float* dst = a.out + ((q0 + it.p0 + r / G) * a.H + it.g * G + r % G) * D;
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(O + r * D + d), inv));
  }
}

void prefill(const at::Tensor& q, at::Tensor out, const at::Tensor& kv_layer, const at::Tensor& tables,
             const at::Tensor& info, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: float32 (T, H, D), each row's H * D contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: contiguous float32, q's shape");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.scalar_type() == at::kFloat && kv_layer.size(1) == 2 &&
              kv_layer.size(4) == q.size(2) && kv_layer.stride(4) == 1 && q.size(1) % kv_layer.size(3) == 0,
              "kv_layer: float32 (blocks, 2, block_size, Hkv, D), Hkv dividing q's heads");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv_layer.size(3), G = H / Hkv;
  TORCH_CHECK(D % 32 == 0 && D <= 256, "head_dim: a multiple of 32, at most 256");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
              info.dim() == 2 && info.size(1) == 3 && info.scalar_type() == at::kLong && info.is_contiguous() &&
              info.size(0) == tables.size(0), "tables (S, nb) and info (S, 3): contiguous int64");
  const int64_t S = info.size(0), nb = tables.size(1), bs = kv_layer.size(2), nblocks = kv_layer.size(0);
  const int64_t* ip = info.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; s++) {
    const int64_t q0 = ip[3 * s], q_len = ip[3 * s + 1], seq_len = ip[3 * s + 2];
    TORCH_CHECK(q0 >= 0 && q_len >= 1 && q0 + q_len <= T, "info: query rows outside q");
    TORCH_CHECK(seq_len >= q_len && seq_len <= nb * bs, "info: seq_len below q_len or past the table's slots");
    for (int64_t b = 0; b < (seq_len + bs - 1) / bs; b++)
      TORCH_CHECK(tp[s * nb + b] >= 0 && tp[s * nb + b] < nblocks, "tables: a block id out of range");
  }
  std::vector<Item> items;
  std::vector<double> cost{0.0};   // running total
  for (int64_t s = 0; s < S; s++)   // a (sequence, KV head)'s items in a row: a thread transposes its K once
    for (int64_t g = 0; g < Hkv; g++)
      for (int64_t p0 = 0; p0 < ip[3 * s + 1]; p0 += QP) {
        const int64_t p1 = std::min(ip[3 * s + 1], p0 + QP);
        items.push_back({s, g, p0, p1});
        cost.push_back(cost.back() + double(p1 - p0) * double(ip[3 * s + 2] - ip[3 * s + 1] + p1));
      }
  const Args a{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(), H, G, D,
               kv_layer.data_ptr<float>(), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
               kv_layer.stride(3), tp, nb, bs, ip, float(scale)};
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (int64_t)items.size()));
  at::parallel_for(0, runs, 1, [&](int64_t t0, int64_t t1) {
    FlushDenormals ftz;
    const int64_t R = QP * G;
    std::vector<float> buf(2 * R * D + R * KC + 2 * R);
    std::vector<const float*> vrow(KC);
    KCache kc;
    float* Q = buf.data(); float* O = Q + R * D; float* Sb = O + R * D;
    float* m = Sb + R * KC; float* l = m + R;
    for (int64_t t = t0; t < t1; t++) {   // run t: the items whose cost midpoint falls in its equal share
      const double lo = cost.back() * t / runs, hi = cost.back() * (t + 1) / runs;
      for (size_t i = 0; i < items.size(); i++) {
        const double mid = (cost[i] + cost[i + 1]) / 2;
        if (mid >= lo && mid < hi) run_item(a, items[i], kc, Q, O, Sb, vrow.data(), m, l);
      }
    }
  });
}
}  // namespace

TORCH_LIBRARY(pdserve_prefill_f32_cpu, m) {
  m.def("prefill(Tensor q, Tensor(a!) out, Tensor kv_layer, Tensor tables, Tensor info, float scale) -> ()");
  m.impl("prefill", c10::DispatchKey::CPU, TORCH_FN(prefill));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the kernel; None when it works here, else why it cannot be used."""
    from pdserve.runtime.cpu_features import cpu_flags

    if missing := sorted(set(NEEDS) - cpu_flags()):
        reason = f"the float32 paged prefill attention kernel needs CPU flags this CPU lacks: {', '.join(missing)}"
    else:
        reason = cpp_build.build("pdserve_prefill_f32_cpu", SOURCE, ["-O3", "-fopenmp", "-mavx2", "-mfma"],
                                 "the float32 paged prefill attention kernel")
    if reason:
        log.warning("%s; float32 CPU prefill attention uses torch's SDPA", reason)
    return reason


def enabled(head_dim: int) -> bool:
    """Whether float32 prefill attention on CPU runs this kernel (head_dim a multiple of 32 up to 256, built)."""
    return head_dim % 32 == 0 and head_dim <= 256 and load_extension() is None
