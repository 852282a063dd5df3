"""A float32 Llama decode step's decoder layers on CPU in one C++ call: the modules' ops, without Python between them.

:func:`forward` runs, for every layer, the ops the eager modules (runtime/models/llama.py) run on this path, in the same
order and through torch's dispatcher: the fused float32 RMSNorm (with the residual add), RoPE and SiLU * up
(kernels/fused_f32_cpu.py), each linear as its module computes it at this row count (its GGUF codes' f32_cpu product
at 1-4 rows, kernels/gguf_codes_linear.py; the small-rows kernel at 1-256, kernels/small_rows_linear.py; else
``F.linear``), the new K/V rows copied into the cache, the paged decode kernel. So its outputs equal the modules' bit
for bit (tests/kernels/test_layer_stack_f32_cpu.py); only the Python between the ops is gone.

Why: on CPUs without AVX-512 (float32 by default) a decode step's ~16 ops a layer each cost a module call, argument
checks and views from Python; the kernels/layer_stack_cpu.py measurement for bf16 found ~180 us a layer of it.

It serves a float32 step whose every query decodes (the paged decode kernel's plan; prefill chunks run the modules)
when every layer is the plain path: dense float32 linears without bias or LoRA (plain, small-rows or with GGUF codes),
no q/k norm, the fused float32 ops on, the KV rows view of the cache. ``PDSERVE_CPU_LAYER_STACK=0`` runs the modules.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import nn

from pdserve.kernels import (cpp_build, fused_f32_cpu, gguf_codes_linear, linear_f32_cpu, paged_decode_cpu,
                             small_rows_linear)
from pdserve.kernels.cpu_simd import STACK_PREAMBLE
from pdserve.kernels.gguf_codes_linear import CodesLinear
from pdserve.kernels.small_rows_linear import ROWS as SMALL_ROWS
from pdserve.kernels.small_rows_linear import SmallRowsLinear

SOURCE = STACK_PREAMBLE + r"""
namespace {
using Codes = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptT&, int64_t, int64_t, bool);

struct Ops {  // resolved once (their libraries are loaded before the first call)
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>("pdserve_fused_f32_cpu::rms_norm");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("pdserve_fused_f32_cpu::rope");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("pdserve_fused_f32_cpu::silu_mul");
  c10::TypedOperatorHandle<Decode> decode = op<Decode>("pdserve_paged_cpu::decode");
};

using SmallRows = at::Tensor(const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<SmallRows>& small_rows_op() {   // x (T, K) @ w^T
  static const auto handle = op<SmallRows>("pdserve_small_rows_f32_cpu::linear");
  return handle;
}

const c10::TypedOperatorHandle<Codes>& codes_op() {  // only where some linear has codes (its library is then loaded)
  static const auto handle = op<Codes>("pdserve_qf32::mm");
  return handle;
}

// One linear as its module computes x (T, K) at T rows. form: [kind, bits, group_size, is_signed], kind 0 F.linear,
// 1 small rows (the small-rows kernel at rows in [lo, hi]), 2 small rows with GGUF codes (codes' product at
// 1..codes_hi rows); codes: [codes, scale, zero (empty: none)] for kind 2; rows: [lo, hi, codes_hi].
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const int64_t* form, const at::Tensor* codes,
                  const int64_t* rows) {
  const int64_t T = x.size(0);
  if (form[0] == 2 && T >= 1 && T <= rows[2]) {
    const OptT zero = codes[2].numel() ? OptT(codes[2]) : OptT();
    return codes_op().call(x.contiguous(), codes[0], codes[1], zero, form[1], form[2], form[3] != 0);
  }
  if (form[0] >= 1 && T >= rows[0] && T <= rows[1]) return small_rows_op().call(x, w);
  return at::linear(x, w);
}

// rows of kv_layer seen as (R, w) floats from its first element: token t's K to row idx[t], its V to row idx[T + t]
void write_kv(float* dst, int64_t w, const at::Tensor& k, const at::Tensor& v, const int64_t* idx, int64_t T) {
  for (int64_t t = 0; t < T; t++) {
    std::memcpy(dst + idx[t] * w, k.data_ptr<float>() + t * k.stride(0), w * 4);
    std::memcpy(dst + idx[T + t] * w, v.data_ptr<float>() + t * v.stride(0), w * 4);
  }
}

// h (T, hidden) float32, every token a decode, through every layer -> the residual stream after the last (before the
// final norm). weights: per layer [input norm, qkv, o, post-attention norm, gate_up, down]; forms: per layer 4 x 4
// ints (see linear); codes: per kind-2 linear 3 tensors, in order; dims: [H, Hkv, D, small lo, small hi, codes hi];
// kv_cache (num_blocks, layers, 2, bs, Hkv, D); kv_idx: the cache rows taking this step's K then V.
at::Tensor forward(const at::Tensor& h0, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                   at::TensorList weights, at::IntArrayRef forms, at::TensorList codes, at::IntArrayRef dims,
                   double eps, double scale, const at::Tensor& kv_idx, const at::Tensor& tables,
                   const at::Tensor& lens) {
  static const Ops ops;
  const int64_t L = kv_cache.dim() == 6 ? kv_cache.size(1) : 0;
  TORCH_CHECK(dims.size() == 6 && L > 0 && (int64_t)weights.size() == 6 * L && (int64_t)forms.size() == 16 * L,
              "dims: 6 sizes; weights: 6, forms: 16 per layer of kv_cache");
  int64_t coded = 0;
  for (int64_t i = 0; i < 4 * L; i++) coded += forms[4 * i] == 2;
  TORCH_CHECK((int64_t)codes.size() == 3 * coded, "codes: 3 tensors per coded linear");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], T = h0.size(0), qs = H * D, ks = Hkv * D;
  TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat, "h: float32 (T, hidden)");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.size(4) == Hkv && kv_cache.size(5) == D &&
              kv_cache.stride(5) == 1 && kv_cache.stride(4) == D && kv_cache.stride(3) == ks &&
              kv_cache.stride(0) % ks == 0 && kv_cache.stride(2) % ks == 0, "kv_cache: float32 rows of Hkv * D");
  TORCH_CHECK(kv_idx.scalar_type() == at::kLong && kv_idx.is_contiguous() && kv_idx.numel() == 2 * T,
              "kv_idx: int64, a K and a V row for each token");
  const int64_t* idx = kv_idx.data_ptr<int64_t>();
  const int64_t num_rows = (kv_cache.size(0) - 1) * (kv_cache.stride(0) / ks) + kv_cache.stride(2) / ks + kv_cache.size(3);
  for (int64_t t = 0; t < 2 * T; t++) TORCH_CHECK(idx[t] >= 0 && idx[t] < num_rows, "kv_idx: a row outside the cache");
  const int64_t* rows = dims.data() + 3;
  const OptT none;
  const at::Tensor* next_codes = codes.data();
  auto lin = [&](const at::Tensor& x, const at::Tensor& w, const int64_t* form) {
    const at::Tensor* c = form[0] == 2 ? next_codes : nullptr;
    if (c) next_codes += 3;
    return linear(x, w, form, c, rows);
  };
  at::Tensor h = h0, mlp;   // mlp: the previous layer's MLP output, added to h by this layer's fused add + RMSNorm
  for (int64_t i = 0; i < L; i++) {
    const at::Tensor* w = weights.data() + 6 * i;
    const int64_t* f = forms.data() + 16 * i;
    const at::Tensor kv_layer = kv_cache.select(1, i);
    at::Tensor x;
    std::tie(x, h) = i ? ops.rms_norm.call(mlp, h, w[0], eps) : ops.rms_norm.call(h, none, w[0], eps);
    const at::Tensor qkv = lin(x, w[1], f);
    const at::Tensor v = qkv.slice(1, qs + ks, qs + 2 * ks).view({T, Hkv, D});
    const at::Tensor qk = ops.rope.call(qkv.slice(1, 0, qs + ks).view({T, H + Hkv, D}), cos, sin);
    write_kv(kv_layer.data_ptr<float>(), ks, qk.slice(1, H, H + Hkv), v, idx, T);
    const at::Tensor o = ops.decode.call(qk.slice(1, 0, H), kv_layer, tables, lens, scale);
    at::Tensor x2;
    std::tie(x2, h) = ops.rms_norm.call(lin(o.reshape({T, qs}), w[2], f + 4), h, w[3], eps);
    mlp = lin(ops.silu_mul.call(lin(x2, w[4], f + 8)), w[5], f + 12);
  }
  return h + mlp;
}
}  // namespace

TORCH_LIBRARY(pdserve_layer_stack_f32_cpu, m) {
  m.def("forward(Tensor h, Tensor cos, Tensor sin, Tensor kv_cache, Tensor[] weights, int[] forms, Tensor[] codes, "
        "int[] dims, float eps, float scale, Tensor kv_idx, Tensor tables, Tensor lens) -> Tensor");
  m.impl("forward", c10::DispatchKey::CPU, TORCH_FN(forward));
}
"""


@functools.lru_cache(maxsize=1)
def load_extension() -> str | None:
    """Builds (first use on this host) or loads the op, after the kernels it calls; None when all of them work here,
    else why not."""
    for ext in (fused_f32_cpu, paged_decode_cpu, small_rows_linear):
        if reason := ext.load_extension():
            return reason
    return cpp_build.build("pdserve_layer_stack_f32_cpu", SOURCE, ["-O2"], "the float32 CPU layer stack")


class Plain(NamedTuple):
    """What :func:`scan` found: the op's arguments for the model, and how many linears have codes / are small-rows."""
    weights: list[torch.Tensor]
    forms: list[int]
    codes: list[torch.Tensor]
    dims: list[int]
    coded: int
    small: int   # small-rows linears without codes


def _form(m: nn.Module) -> tuple[list[int], list[torch.Tensor]] | None:
    """A linear's [kind, bits, group_size, is_signed] and codes tensors (see the C++ ``linear``), or None: not plain."""
    if type(m) not in (nn.Linear, SmallRowsLinear, CodesLinear) or m.bias is not None \
            or m.weight.dtype != torch.float32 or not m.weight.is_contiguous():   # the kernels read it in place
        return None
    if type(m) is nn.Linear:
        return [0, 0, 0, 0], []
    if type(m) is SmallRowsLinear:
        return [1, 0, 0, 0], []
    if type(m) is CodesLinear and m.codes.bias is None:
        c = m.codes
        return [2, c.bits, c.group_size, int(c.is_signed)], [c.codes, c.scale, c.zero if c.zero is not None
                                                             else torch.empty(0)]
    return None


def scan(model: Any) -> Plain | None:
    """The op's per-layer weights, linear forms and codes for ``model``'s layers, or None unless every layer is plain."""
    weights: list[torch.Tensor] = []
    forms: list[int] = []
    codes: list[torch.Tensor] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        lins = [_form(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if attn.q_norm is not None or any(n.dtype != torch.float32 for n in norms) or None in lins:
            return None
        weights += [norms[0], attn.qkv_proj.weight, attn.o_proj.weight, norms[1], mlp.gate_up_proj.weight,
                    mlp.down_proj.weight]
        for form, c in lins:
            forms += form
            codes += c
    if codes and linear_f32_cpu.load_extension() is not None:
        return None
    a = model.args
    dims = [a.num_heads, a.num_kv_heads, a.head_dim, SMALL_ROWS.start, SMALL_ROWS.stop - 1,
            gguf_codes_linear.ROWS.stop - 1]
    return Plain(weights, forms, codes, dims, len(codes) // 3, forms[::4].count(1))


def forward(model: Any, plain: Plain, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            plan: Any) -> torch.Tensor | None:
    """The residual stream after the last layer, or None (the step has prefills, or the ops are off: the modules
    run). Counts the products it ran on the small-rows and GGUF-codes paths in their modules' counters."""
    if plan.paged is None or plan.paged[0] is not None or plan.decode_groups or plan.prefills \
            or not fused_f32_cpu.enabled(h) or load_extension() is not None:
        return None
    _, tables, lens = plan.paged
    out = torch.ops.pdserve_layer_stack_f32_cpu.forward(h, cos, sin, kv_cache, plain.weights, plain.forms, plain.codes,
                                                        plain.dims, model.args.rms_norm_eps,
                                                        model.layers[0].self_attn.scale, plan.kv_rows, tables, lens)
    rows = h.shape[0]   # the products each path served, as the modules would have counted them
    coded_here = rows in gguf_codes_linear.ROWS
    CodesLinear.served += plain.coded if coded_here else 0
    SmallRowsLinear.served += (plain.small + (0 if coded_here else plain.coded)) if rows in SMALL_ROWS else 0
    return out
