"""A bf16 Llama step's decoder layers on CPU in one C++ call: the same kernels, without Python between them.

:class:`LayerStack` runs, for every layer, exactly the ops the eager modules (runtime/models/llama.py) run on this
path and in the same order: the fused RMSNorm, the AMX linears, the fused RoPE, the new K/V rows copied into the cache
(as the modules' ``index_copy_`` does), the paged prefill and/or paged decode attention kernels, the fused add +
RMSNorm and SiLU * up, the residual add (fused into the next layer's input RMSNorm, which adds as the eager add
does: the same bits). The C++ loop calls those ops through torch's dispatcher, so its outputs equal
the modules' bit for bit (tests/kernels/test_layer_stack_cpu.py); only the Python between them is gone.

Why: a step of a few tokens on this path costs the weights' read plus ~120 kernel calls, and each call from Python
cost a module call, argument checks and views: ~180 us a layer (a decode step at one running sequence, 17.7 ms with
the modules, 12.1 ms in one call: benchmarks/layer_stack.py). CUDA graphs remove the same cost on GPU.

It serves a step when every layer is the plain bf16 path: AMX linears without bias or LoRA, no q/k norm, the fused ops
and both paged attention kernels on, the KV rows view of the cache, at most ``amx_linear.MAX_ROWS`` tokens (above, the
linears switch to oneDNN and the dispatch cost is small next to the work). Otherwise, or with
``PDSERVE_CPU_LAYER_STACK=0``, the modules run as before. A float32 step goes to kernels/layer_stack_f32_cpu.py
instead (decode steps). ``steps`` counts the steps either served.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pdserve.kernels import amx_linear, cpp_build, fused_cpu, layer_stack_f32_cpu, paged_decode_cpu, paged_prefill_cpu
from pdserve.kernels.base import AttentionMetadata, kv_token_rows
from pdserve.kernels.cpu_simd import STACK_PREAMBLE

SOURCE = STACK_PREAMBLE + r"""
namespace {
using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptT&, int64_t, const OptT&);
using Prefill = void(const at::Tensor&, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

struct Ops {  // the kernels' own ops, resolved once (their libraries are loaded before the first call)
  c10::TypedOperatorHandle<Linear> linear = op<Linear>("pdserve_amx_linear::linear");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>("pdserve_fused_cpu::rms_norm");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("pdserve_fused_cpu::rope");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("pdserve_fused_cpu::silu_mul");
  c10::TypedOperatorHandle<Decode> decode = op<Decode>("pdserve_paged_cpu::decode");
  c10::TypedOperatorHandle<Prefill> prefill = op<Prefill>("pdserve_prefill_cpu::prefill");
};

// This step's K then V into a layer's cache seen as rows of w words from its first element: token t's K to row
// idx[t], its V to row idx[T + t] (what the modules' index_copy_ of the concatenated rows writes, without the
// concatenated copy). k, v (T, Hkv, D) bf16 views, each token's Hkv * D contiguous; idx checked once a step.
void write_kv(uint16_t* dst, int64_t w, const at::Tensor& k, const at::Tensor& v, const int64_t* idx, int64_t T) {
  for (int64_t t = 0; t < T; t++) {
    std::memcpy(dst + idx[t] * w, (const uint16_t*)k.data_ptr() + t * k.stride(0), w * 2);
    std::memcpy(dst + idx[T + t] * w, (const uint16_t*)v.data_ptr() + t * v.stride(0), w * 2);
  }
}

// h (T, hidden) bf16 through every layer; returns the residual stream after the last (before the final norm).
// weights: per layer [input norm, qkv, o, post-attention norm, gate_up, down] (linears packed for AMX, as tiles or
// codes); metas: empty, or per layer the four linears' coded-weight meta (kernels/bf16_codec.py); dims:
// [H, Hkv, D, n_qkv, n_o, n_gate_up, n_down]; kv_cache (num_blocks, layers, 2, bs, Hkv, D); kv_idx: the rows of the
// cache's row view that take this step's K then V; dec_*: the decodes for the paged decode kernel (dec_rows: their rows
// of q, absent when every row decodes); pf_*: the prefill chunks for the paged prefill kernel.
at::Tensor forward(const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                   at::TensorList weights, at::TensorList metas, at::IntArrayRef dims, double eps, double scale,
                   const at::Tensor& kv_idx,
                   const OptT& dec_rows, const OptT& dec_tables, const OptT& dec_lens, const OptT& pf_tables,
                   const OptT& pf_info) {
  static const Ops ops;
  TORCH_CHECK(dims.size() == 7 && kv_cache.dim() == 6 && (int64_t)weights.size() == 6 * kv_cache.size(1) &&
              (metas.empty() || (int64_t)metas.size() == 4 * kv_cache.size(1)),
              "dims: 7 sizes; weights: 6 per layer of kv_cache, metas: none or 4");
  TORCH_CHECK(dec_tables.has_value() == dec_lens.has_value() && pf_tables.has_value() == pf_info.has_value() &&
              (dec_tables.has_value() || pf_tables.has_value()) &&
              dec_rows.has_value() == (dec_tables.has_value() && pf_tables.has_value()),
              "decodes need tables and lens, prefills tables and info; decode rows exactly beside prefills");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], nqkv = dims[3], no = dims[4], ngu = dims[5], nd = dims[6];
  const int64_t T = h0.size(0), qs = H * D, ks = Hkv * D, L = kv_cache.size(1);
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 && kv_cache.size(4) == Hkv && kv_cache.size(5) == D &&
              kv_cache.stride(5) == 1 && kv_cache.stride(4) == D && kv_cache.stride(3) == ks &&
              kv_cache.stride(0) % ks == 0 && kv_cache.stride(2) % ks == 0, "kv_cache: bf16 rows of Hkv * D");
  TORCH_CHECK(kv_idx.scalar_type() == at::kLong && kv_idx.is_contiguous() && kv_idx.numel() == 2 * T,
              "kv_idx: int64, a K and a V row for each token");
  const int64_t* idx = kv_idx.data_ptr<int64_t>();
  const int64_t num_rows = (kv_cache.size(0) - 1) * (kv_cache.stride(0) / ks) + kv_cache.stride(2) / ks + kv_cache.size(3);
  for (int64_t t = 0; t < 2 * T; t++) TORCH_CHECK(idx[t] >= 0 && idx[t] < num_rows, "kv_idx: a row outside the cache");
  const OptT none;
  auto meta = [&](int64_t i, int64_t l) { return metas.empty() ? none : OptT(metas[4 * i + l]); };   // linear l's
  at::Tensor h = h0, mlp;   // mlp: the previous layer's MLP output, added to h by this layer's fused add + RMSNorm
  for (int64_t i = 0; i < L; i++) {
    const at::Tensor* w = weights.data() + 6 * i;
    const at::Tensor kv_layer = kv_cache.select(1, i);
    at::Tensor x;
    std::tie(x, h) = i ? ops.rms_norm.call(mlp, h, w[0], eps) : ops.rms_norm.call(h, none, w[0], eps);
    const at::Tensor qkv = ops.linear.call(x, w[1], none, nqkv, meta(i, 0));
    const at::Tensor v = qkv.slice(1, qs + ks, nqkv).view({T, Hkv, D});
    const at::Tensor qk = ops.rope.call(qkv.slice(1, 0, qs + ks).view({T, H + Hkv, D}), cos, sin);
    const at::Tensor q = qk.slice(1, 0, H), k = qk.slice(1, H, H + Hkv);
    write_kv((uint16_t*)kv_layer.data_ptr(), ks, k, v, idx, T);
    at::Tensor o;
    if (!pf_tables.has_value()) {
      o = ops.decode.call(q, kv_layer, *dec_tables, *dec_lens, scale);
    } else {
      o = at::empty_like(q);
      ops.prefill.call(q, o, kv_layer, *pf_tables, *pf_info, scale);
      if (dec_tables.has_value())
        o.index_copy_(0, *dec_rows, ops.decode.call(q.index_select(0, *dec_rows), kv_layer, *dec_tables, *dec_lens, scale));
    }
    const at::Tensor a = ops.linear.call(o.reshape({T, qs}), w[2], none, no, meta(i, 1));
    at::Tensor x2;
    std::tie(x2, h) = ops.rms_norm.call(a, h, w[3], eps);
    const at::Tensor gate_up = ops.linear.call(x2, w[4], none, ngu, meta(i, 2));
    mlp = ops.linear.call(ops.silu_mul.call(gate_up), w[5], none, nd, meta(i, 3));
  }
  return h + mlp;
}
}  // namespace

TORCH_LIBRARY(pdserve_layer_stack_cpu, m) {
  m.def("forward(Tensor h, Tensor cos, Tensor sin, Tensor kv_cache, Tensor[] weights, Tensor[] metas, int[] dims, "
        "float eps, float scale, Tensor kv_idx, Tensor? dec_rows, Tensor? dec_tables, Tensor? dec_lens, "
        "Tensor? pf_tables, Tensor? pf_info) -> Tensor");
  m.impl("forward", c10::DispatchKey::CPU, TORCH_FN(forward));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the op, after the kernels it calls; None when all of them work here,
    else why not."""
    for ext in (amx_linear, fused_cpu, paged_decode_cpu, paged_prefill_cpu):
        if reason := ext.load_extension():
            return reason
    return cpp_build.build("pdserve_layer_stack_cpu", SOURCE, ["-O2"], "the CPU layer stack")


Plain = tuple[list[torch.Tensor], list[torch.Tensor], list[int]]   # the op's weights, metas and dims


class LayerStack:
    """``model``'s decoder layers as one op call where the step allows it (see the module doc); ``steps`` counts them."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.steps = 0
        self._plain: tuple[Any, Plain | None] | None = None   # (first qkv, _scan())
        self._plain_f32: tuple[Any, layer_stack_f32_cpu.Plain | None] | None = None   # (first qkv, scan())

    def _plain_layers(self) -> Plain | None:
        """(every layer's [norm, qkv, o, norm, gate_up, down] tensors, their linears' coded-weight metas or [], the
        op's dims), or None unless every layer is the plain path, its linears all coded or all plain tiles; scanned
        again only when the linears were replaced (quantization and LoRA replace them all)."""
        first = self.model.layers[0].self_attn.qkv_proj
        if self._plain is None or self._plain[0] is not first:
            self._plain = (first, self._scan())
        return self._plain[1]

    def _scan(self) -> Plain | None:
        weights: list[torch.Tensor] = []
        metas: list[torch.Tensor] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (attn.q_norm is not None or any(n.dtype != torch.bfloat16 for n in norms)
                    or any(type(m) is not amx_linear.AmxLinear or m.bias is not None for m in lins)):
                return None
            (q, q_meta), (o, o_meta), (gu, gu_meta), (d, d_meta) = (m.kernel_weight for m in lins)
            weights += [norms[0], q, o, norms[1], gu, d]
            metas += [m for m in (q_meta, o_meta, gu_meta, d_meta) if m is not None]
        if metas and len(metas) != 4 * len(self.model.layers):
            return None
        a, l0 = self.model.args, self.model.layers[0]
        dims = [a.num_heads, a.num_kv_heads, a.head_dim, *(m.out_features for m in (
            l0.self_attn.qkv_proj, l0.self_attn.o_proj, l0.mlp.gate_up_proj, l0.mlp.down_proj))]
        if dims[5] % 32 or a.head_dim % 32:   # the fused SiLU * up and RoPE take halves of whole vectors (else eager)
            return None
        return weights, metas, dims

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """The residual stream after the last layer (before the final norm), or None: the modules run this step."""
        from pdserve.runtime import envs

        if h.dtype == torch.float32 and h.device.type == "cpu" and envs.cpu_layer_stack():
            return self._float32(h, cos, sin, kv_cache, meta)
        if (h.shape[0] > amx_linear.MAX_ROWS or h.dtype != torch.bfloat16 or h.device.type != "cpu"
                or kv_cache.dtype != torch.bfloat16
                or not envs.cpu_layer_stack() or not fused_cpu.enabled(h) or load_extension() is not None):
            return None
        plain = self._plain_layers()
        attn0 = self.model.layers[0].self_attn
        backend, kv0 = attn0.backend, kv_cache[:, 0]
        if plain is None or not hasattr(backend, "step_plan") or kv_token_rows(kv0) is None:
            return None
        plan = backend.step_plan(meta, kv0, h.dtype)
        if plan.decode_groups or plan.prefills:   # torch fallbacks the kernels do not serve
            return None
        out = torch.ops.pdserve_layer_stack_cpu.forward(h, cos, sin, kv_cache, *plain, self.model.args.rms_norm_eps,
                                                        attn0.scale, plan.kv_rows, *(plan.paged or (None,) * 3),
                                                        *(plan.paged_prefill or (None,) * 2))
        self.steps += 1
        return out

    def _float32(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor | None:
        """A float32 decode step in one call (kernels/layer_stack_f32_cpu.py), or None."""
        first = self.model.layers[0].self_attn.qkv_proj
        if self._plain_f32 is None or self._plain_f32[0] is not first:
            self._plain_f32 = (first, layer_stack_f32_cpu.scan(self.model))
        attn0, kv0 = self.model.layers[0].self_attn, kv_cache[:, 0]
        if self._plain_f32[1] is None or not hasattr(attn0.backend, "step_plan") or kv_token_rows(kv0) is None:
            return None
        out = layer_stack_f32_cpu.forward(self.model, self._plain_f32[1], h, cos, sin, kv_cache,
                                          attn0.backend.step_plan(meta, kv0, h.dtype))
        self.steps += out is not None
        return out
