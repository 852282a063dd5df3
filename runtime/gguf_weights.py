"""GGUF tensors kept quantized: Q4_0 / Q4_1 / Q8_0 blocks decoded into :class:`QuantizedWeight` codes, float tensors as is.

Block layouts (llama.cpp ``ggml-common.h``), 32 weights per block along a row (the input dimension)::

    Q4_0: d fp16, qs[16]      w = d * (q - 8)     q = low nibbles (elements 0..15), then high nibbles (16..31)
    Q4_1: d fp16, m fp16, qs  w = d * q + m
    Q8_0: d fp16, qs[32] int8 w = d * q

Each decodes to ``scale * code + zero`` with the same float32 operations gguf-py uses to dequantize (Q4_0 keeps the
signed code ``q - 8``), so ``QuantizedWeight.dequantize()`` equals the float32 weights transformers loads bit for bit.
Names map onto HF Llama names, and q/k rows get transformers' inverse of llama.cpp's RoPE row permutation (rows are
independent blocks, so permuting codes and scales is exact).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pdserve.kernels.linear_base import QuantizedWeight

_BLOCK = 32
_LAYOUT = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32-weight block
_FLOAT = {"F32", "F16", "BF16"}
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class GGUFFormatError(ValueError):
    """A GGUF file that cannot be kept quantized: corrupt, or with a tensor type or architecture pdserve lacks."""


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int], name: str) -> QuantizedWeight:
    """(N, K) weight from ``raw`` (N, K/32 * block bytes) uint8 GGUF blocks; raises naming ``name`` when corrupt."""
    n, k = shape
    fmt = f"GGUF {type_name}"
    nbytes = _LAYOUT[type_name]
    if k % _BLOCK or raw.size != n * (k // _BLOCK) * nbytes:
        raise GGUFFormatError(f"tensor {name!r} ({fmt}, shape {shape}): {raw.size} bytes of block data, expected "
                              f"{n * (k // _BLOCK) * nbytes} (corrupt or truncated file?)")
    blocks = torch.from_numpy(np.array(raw, copy=True).reshape(n, k // _BLOCK, nbytes))    # (N, G, bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()                   # (N, G)
    if type_name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        scale, zero, code = d, None, q
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]                    # (N, G, 16)
        code = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)                         # element j<16: low nibble
        if type_name == "Q4_1":
            scale, zero = d, blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        else:
            scale, zero, code = d, None, (code.to(torch.int8) - 8)                          # signed, as gguf-py does
    bad = ~torch.isfinite(scale) if zero is None else ~(torch.isfinite(scale) & torch.isfinite(zero))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise GGUFFormatError(f"tensor {name!r} ({fmt}): non-finite block scale in row {row} (corrupt file?)")
    bits = 8 if type_name == "Q8_0" else 4
    return QuantizedWeight(code.contiguous(), scale, zero, _BLOCK, bits, fmt)


def _unpermute_rows(num_heads: int, n: int) -> torch.Tensor:
    """Row index undoing llama.cpp's q/k permutation (transformers' ``reverse_permute_weights``)."""
    return torch.arange(n).reshape(num_heads, n // num_heads // 2, 2).transpose(1, 2).reshape(n)


def iter_gguf_weights(path: Path, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield ``(hf_name, float tensor | QuantizedWeight)`` for every tensor of a Llama GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file to the user
        raise GGUFFormatError(f"GGUF file {path} is corrupt or unreadable ({type(e).__name__}: {e})") from e
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else "?"
    if arch != "llama":
        raise GGUFFormatError(f"GGUF file {path} has architecture {arch!r}; only 'llama' can be kept quantized "
                              "(use --quantization none to dequantize it at load)")
    for t in reader.tensors:
        name, type_name = hf_name(t.name), t.tensor_type.name
        if name is None:
            raise GGUFFormatError(f"GGUF tensor {t.name!r} ({type_name}) has no Llama counterpart")
        shape = tuple(int(s) for s in reversed(list(t.shape)))                             # GGUF lists ne0 (K) first
        if type_name in _FLOAT:
            value: torch.Tensor | QuantizedWeight = torch.from_numpy(np.array(t.data, copy=True)).float().reshape(shape)
        elif type_name in _LAYOUT:
            if len(shape) != 2:
                raise GGUFFormatError(f"tensor {t.name!r} ({type_name}) has shape {shape}; quantized tensors are 2-D")
            value = decode_blocks(np.asarray(t.data), type_name, shape, t.name)            # type: ignore[arg-type]
        else:
            raise GGUFFormatError(f"tensor {t.name!r} has GGUF type {type_name}, which pdserve cannot keep quantized "
                                  f"(supported: Q4_0, Q4_1, Q8_0, F32, F16, BF16); use --quantization none")
        for proj, heads in (("q_proj", num_heads), ("k_proj", num_kv_heads)):
            if f".self_attn.{proj}." in name:
                idx = _unpermute_rows(heads, shape[0])
                value = value.rows(idx) if isinstance(value, QuantizedWeight) else value[idx]
        yield name, value
