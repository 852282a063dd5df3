"""The Llama family in one file: Llama 2/3 (incl. rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k norm).

Config-driven: ``LlamaArgs.from_hf`` reads the few knobs that differ between the architectures; the module tree is the
same for all of them. Attention reads and writes the paged KV cache through an ``AttentionBackend``; there is no
per-request state in the model. Numerics follow Hugging Face transformers (RMSNorm in float32, rotate_half RoPE with
float32 cos/sin cast to the compute dtype) so that float32 greedy output matches it token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import fused_cpu
from pdserve.kernels.layer_stack_cpu import LayerStack
from pdserve.kernels.base import AttentionBackend, AttentionMetadata
from pdserve.kernels.linear_base import QuantizedWeight, quantized_linear


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int               # < num_heads: grouped-query attention
    head_dim: int                   # explicit in Qwen3/Mistral configs; hidden_size // num_heads otherwise
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None       # HF rope_parameters / rope_scaling; None or rope_type "default" = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool       # lm_head shares the embedding matrix (SmolLM2, small Qwens)
    qkv_bias: bool                  # Qwen2: bias on q/k/v only
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool                   # Qwen3: RMSNorm over head_dim on q and k before RoPE

    @classmethod
    def from_hf(cls, cfg: Any, max_model_len: int) -> "LlamaArgs":
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}: the Llama family uses SwiGLU (silu)")
        model_type = getattr(cfg, "model_type", "llama")
        window = _sliding_window(cfg, model_type)
        if window is not None and max_model_len > window:
            raise ValueError(f"{model_type} uses sliding-window attention (window {window}), which pdserve does not "
                             f"implement; set max_model_len <= {window} so that it equals full attention")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            rope_scaling=dict(rope) if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


def _sliding_window(cfg: Any, model_type: str) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    if model_type == "mistral":
        return window
    layer_types = getattr(cfg, "layer_types", None) or []
    return window if "sliding_attention" in layer_types else None  # Qwen2/3: only with use_sliding_window


def rope_inv_freq(args: LlamaArgs, max_model_len: int) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) float32 for the configured rope type: default, linear, llama3, dynamic."""
    dim, base = args.head_dim, args.rope_theta
    scaling = args.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "dynamic" and max_model_len > args.max_position_embeddings:
        # HF recomputes the base per forward from the current length, which a KV cache cannot follow; like vLLM we fix
        # it at max_model_len (identical to HF while every sequence stays within max_position_embeddings).
        factor = scaling["factor"]
        base = base * ((factor * max_model_len / args.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, dynamic")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.weight.dtype == x.dtype and (ops := fused_cpu.ops_for(x)):
            return ops.rms_norm(x, None, self.weight, self.eps)[0]
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * r if h is x else h.mul_(r)   # a low-precision input's float copy is ours to scale in place
        h = h.to(x.dtype)
        return h.mul_(self.weight) if h.dtype == self.weight.dtype else self.weight * h   # same products, one buffer

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: one pass with the fused CPU op."""
        if x.dim() == 2 and self.weight.dtype == x.dtype == residual.dtype and (ops := fused_cpu.ops_for(x)):
            return ops.rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self.forward(h), h


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.backend = backend
        self.scale = args.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_layer, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """(T, hidden) -> (T, hidden), or only the rows ``keep`` after attention (every row's K/V is still cached)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)                             # (T, q_size + 2 * kv_size)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)    # (T, Hkv, D)
        if self.q_norm is None:   # RoPE on q and k as one (T, H + Hkv, D) view: half the eager elementwise ops
            qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
            if cos.dtype == qk.dtype and (ops := fused_cpu.ops_for(qk, 32)):
                qk = ops.rope(qk, cos, sin)
            else:
                qk = qk * cos + rotate_half(qk) * sin      # cos/sin: (T, 1, D)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]   # (T, H, D), (T, Hkv, D)
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))      # (T, H, D)
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))   # (T, Hkv, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        o = self.backend.forward(q, k, v, kv_layer, meta, self.scale).reshape(T, self.q_size)  # (T, H * D)
        return self.o_proj(o if keep is None else o[keep])   # (T or N, hidden)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                     # (T, 2 * intermediate)
        if ops := fused_cpu.ops_for(gate_up, 32):
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)                # 2 x (T, intermediate)
        return self.down_proj(F.silu(gate).mul_(up))   # in place: one (T, intermediate) buffer less


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, h, cos, sin, kv_layer, meta, keep: torch.Tensor | None = None):
        """(T, hidden) -> (T, hidden), or only the rows ``keep`` past attention (see :meth:`Attention.forward`)."""
        a = self.self_attn(self.input_layernorm(h), cos, sin, kv_layer, meta, keep)
        x, h = self.post_attention_layernorm.add_forward(a, h if keep is None else h[keep])
        return h + self.mlp(x)


# HF parameter name suffix -> (our fused parameter, shard index); shards are concatenated along dim 0 in index order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
}

_NUM_SHARDS = {ours: sum(1 for o, _ in _FUSED.values() if o == ours) for ours, _ in _FUSED.values()}


def _fused(name: str) -> tuple[str, int] | None:
    """Our fused parameter and shard index for a parameter of an HF linear we fuse ("layers.0.self_attn.k_proj.weight"
    -> ("layers.0.self_attn.qkv_proj.weight", 1)), else None."""
    for hf_part, (ours, idx) in _FUSED.items():
        if f".{hf_part}." in f".{name}":
            return name.replace(hf_part, ours), idx
    return None


def _complete(name: str, parts: dict) -> bool:
    """Whether ``parts`` holds every shard of the fused parameter ``name`` ("layers.0.mlp.gate_up_proj.weight")."""
    return len(parts) == _NUM_SHARDS[name.rpartition(".")[0].split(".", 2)[-1]]
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # quantized at load


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids (T,), positions (T,), kv_cache, attn_meta) -> hidden (T, hidden_size)``, then
    ``compute_logits(rows (N, hidden)) -> (N, vocab)`` float32. ``kv_cache`` is the whole model's cache
    ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; layer i reads and writes ``kv_cache[:, i]``.

    Build under ``torch.device("meta")`` and call :meth:`load_weights` to materialize it on the target device.
    """

    def __init__(self, hf_config: Any, backend: AttentionBackend, max_model_len: int | None = None):
        super().__init__()
        self.max_model_len = max_model_len or hf_config.max_position_embeddings
        self.args = args = LlamaArgs.from_hf(hf_config, self.max_model_len)
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        # an uninitialized table: on the meta device nn.Embedding's own init (normal_) costs ~1 s of torch imports
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(args, backend) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("cos_sin", None, persistent=False)  # (max_model_len, 2, D) float32, set by load_weights
        self.quant_head: nn.Module | None = None  # tied LM head over a quantized embedding (see load_weights)
        self.head_gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear   # the LM head's product
        self.layer_stack = LayerStack(self)   # a small bf16 CPU step's layers in one C++ call, where it applies

    def forward(self, input_ids, positions, kv_cache, attn_meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states (T, hidden), or (``keep``: row indices) only those rows': the last layer then runs
        its output projection and MLP on them alone, since no other row's state is read (the K/V of every row is
        cached before that). A prefill chunk samples at most its last row, so a long one skips most of a layer."""
        h = self.embed_tokens(input_ids)                                  # (T, hidden)
        cos, sin = self.cos_sin[positions].to(h.dtype).unbind(1)          # 2 x (T, D)
        cos, sin = cos[:, None, :], sin[:, None, :]                       # (T, 1, D): broadcast over heads
        if (out := self.layer_stack(h, cos, sin, kv_cache, attn_meta)) is not None:
            return self.norm(out if keep is None else out[keep])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[:, i], attn_meta, keep if i == last else None)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_head is not None:
            return self.quant_head(hidden).float()                        # (N, vocab)
        if not isinstance(self.lm_head, (nn.Linear, type(None))):
            return self.lm_head(hidden).float()                           # a quantized LM head
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.head_gemm(hidden, weight).float()                     # (N, vocab)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], device: torch.device,
                     dtype: torch.dtype, quantize_at_load: Callable[[torch.Tensor], QuantizedWeight] | None = None,
                     ) -> None:
        """Materialize every parameter from ``(hf_name, tensor)`` pairs; raises on missing or unexpected weights.

        A value may be a :class:`QuantizedWeight` (GGUF blocks, compressed-tensors): a linear layer then becomes the
        quantized linear of the registry, the embedding a quantized lookup (and, when tied, the LM head too).
        ``quantize_at_load`` turns the float weights of the decoder's linear layers into quantized ones."""
        params = dict(self.named_parameters())
        shards: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        self._quantized: dict[str, QuantizedWeight] = {}  # module name -> weight, built once biases are loaded
        self._quantize_at_load = quantize_at_load
        try:
            self._load(weights, params, shards, loaded, device, dtype)
        finally:
            del self._quantized, self._quantize_at_load  # drop the unpacked codes: only the packed modules stay
        freqs = torch.outer(torch.arange(self.max_model_len, dtype=torch.float32), rope_inv_freq(self.args, self.max_model_len))
        emb = torch.cat((freqs, freqs), dim=-1)                           # (max_model_len, D)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1).to(device)  # (max_model_len, 2, D)

    def quantized_twins(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
                        ) -> dict[str, QuantizedWeight]:
        """The quantized values among ``(hf_name, tensor)`` pairs, by our module name ("embed_tokens",
        "layers.0.self_attn.qkv_proj", ...): fused shards concatenated when all are quantized alike, else left out."""
        found: dict[str, QuantizedWeight] = {}
        shards: dict[str, dict[int, QuantizedWeight]] = {}
        for hf_name, value in weights:
            name = hf_name.removeprefix("model.")
            if not isinstance(value, QuantizedWeight) or not name.endswith(".weight"):
                continue
            if (fused := _fused(name)) is not None:
                shards.setdefault(fused[0], {})[fused[1]] = value
            else:
                found[name.removesuffix(".weight")] = value
        for name, parts in shards.items():
            if _complete(name, parts):
                try:
                    found[name.removesuffix(".weight")] = QuantizedWeight.cat([parts[i] for i in sorted(parts)])
                except ValueError:
                    pass   # shards quantized differently: no twin
        return found

    def _load(self, weights, params, shards, loaded, device, dtype) -> None:
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / tied to the embedding
            if (fused := _fused(name)) is not None:
                shards.setdefault(fused[0], {})[fused[1]] = tensor
            else:
                self._assign(params, name, tensor, device, dtype)
                loaded.add(name)
        for name, parts in shards.items():
            if not _complete(name, parts):
                continue  # incomplete: reported as missing below
            ordered = [parts[i] for i in sorted(parts)]
            if all(isinstance(p, QuantizedWeight) for p in ordered):
                fused: torch.Tensor | QuantizedWeight = QuantizedWeight.cat(ordered)
            elif any(isinstance(p, QuantizedWeight) for p in ordered):
                fused = torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in ordered])
            else:
                fused = torch.cat(ordered, dim=0)
            self._assign(params, name, fused, device, dtype)
            loaded.add(name)
        for module_name, qw in self._quantized.items():
            parent, _, child = module_name.rpartition(".")
            bias = getattr(self.get_submodule(module_name), "bias", None)
            if bias is not None and bias.is_meta:
                continue  # bias missing: reported below
            setattr(self.get_submodule(parent) if parent else self, child,
                    quantized_linear(qw, bias, torch.device(device), dtype, f"{module_name}.weight"))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def _assign(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, device, dtype) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        module_name, _, attr = name.rpartition(".")
        module = self.get_submodule(module_name)
        quantize = getattr(self, "_quantize_at_load", None)
        if quantize is not None and attr == "weight" and not isinstance(tensor, QuantizedWeight) \
                and module_name.split(".", 2)[-1] in _LINEARS:
            tensor = quantize(tensor)
        if isinstance(tensor, QuantizedWeight):
            if isinstance(module, nn.Embedding):
                from pdserve.runtime.quantization import QuantEmbedding

                self.embed_tokens = QuantEmbedding(tensor, torch.device(device), dtype)
                if self.lm_head is None:  # tied: the LM head reads the same codes
                    self.quant_head = quantized_linear(tensor, None, torch.device(device), dtype, name)
            elif isinstance(module, nn.Linear):
                self._quantized[module_name] = tensor
            else:
                raise ValueError(f"weight {name!r} is quantized ({tensor.fmt}) but {type(module).__name__} "
                                 "parameters must be float")
            return
        setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
