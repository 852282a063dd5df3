"""compressed-tensors checkpoints (the llm-compressor format vLLM loads), read directly from safetensors.

``config.json`` carries ``quantization_config = {"quant_method": "compressed-tensors", "format": ..., "config_groups":
{name: {"targets": [...], "weights": {"num_bits", "type", "symmetric", "strategy", "group_size"}, ...}}, "ignore": [...]}``.
Supported weight formats (integer, weight-only kernels; activation quantization of W8A8 is not applied - weights
are exact, activations stay in the compute dtype, which is logged):

* ``pack-quantized`` (W4A16, W8A16): ``<module>.weight_packed`` int32 (N, ceil(K / (32 / bits))), each word holding
  ``32 / bits`` codes offset by ``2**(bits-1)``, element ``j * f + i`` in bits ``[bits*i, bits*(i+1))`` of word j;
  ``<module>.weight_scale`` (N, K / group_size) or (N, 1); ``<module>.weight_shape`` = [N, K];
* ``int-quantized`` / ``naive-quantized`` (INT8 W8A8 / W8A16): ``<module>.weight`` int8 (N, K) + ``weight_scale``.

Weights are ``scale * q`` (symmetric) or ``scale * (q - zero_point)`` with an unpacked zero point. Anything else is a
:class:`CompressedTensorsError` naming the tensor and the format.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pdserve.kernels.linear_base import QuantizedWeight

_PACKED = "pack-quantized"
_INT = ("int-quantized", "naive-quantized")


class CompressedTensorsError(ValueError):
    """A compressed-tensors checkpoint pdserve cannot load: unsupported scheme, or corrupt tensors."""


def is_compressed_tensors(hf_config: Any) -> bool:
    qc = _qconfig(hf_config)
    return bool(qc) and qc.get("quant_method") == "compressed-tensors"


def _qconfig(hf_config: Any) -> dict:
    qc = getattr(hf_config, "quantization_config", None)
    return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else {})


def check_config(hf_config: Any) -> tuple[str, dict]:
    """``(format, weights scheme)`` of a supported checkpoint; raises CompressedTensorsError otherwise."""
    qc = _qconfig(hf_config)
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if fmt not in (_PACKED, *_INT):
        raise CompressedTensorsError(f"compressed-tensors format {fmt!r} is not supported (supported: {_PACKED}, "
                                     f"{', '.join(_INT)}); FP8 and sparse formats need a GPU kernel pdserve lacks")
    schemes = [g.get("weights") or {} for g in groups.values()]
    if len(schemes) != 1:
        raise CompressedTensorsError(f"compressed-tensors checkpoint has {len(schemes)} config groups; pdserve "
                                     "supports exactly one weight scheme")
    w = schemes[0]
    if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
        raise CompressedTensorsError(f"compressed-tensors weight scheme {w} is not supported: integer 4 or 8 bits only")
    if w.get("strategy") not in ("channel", "group", "tensor"):
        raise CompressedTensorsError(f"compressed-tensors weight strategy {w.get('strategy')!r} is not supported "
                                     "(supported: channel, group, tensor)")
    if fmt in _INT and w["num_bits"] != 8:
        raise CompressedTensorsError(f"compressed-tensors format {fmt} with {w['num_bits']} bits is not supported")
    return fmt, w


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """(N, ceil(K/f)) int32 words -> (N, K) int8 signed codes (see the module docstring for the bit order)."""
    f, mask = 32 // bits, (1 << bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF                                   # the words as unsigned
    codes = torch.stack([(words >> (bits * i)) & mask for i in range(f)], dim=-1)  # (N, K/f, f)
    return (codes.reshape(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))).to(torch.int8)


def iter_weights(tensors: Iterator[tuple[str, torch.Tensor]], hf_config: Any) -> Iterator[tuple[str, Any]]:
    """Turn a compressed-tensors checkpoint's ``(name, tensor)`` stream into ``(hf_name, tensor | QuantizedWeight)``."""
    fmt, scheme = check_config(hf_config)
    bits = scheme["num_bits"]
    label = f"compressed-tensors {fmt} int{bits} {scheme['strategy']}"
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx") or (
                leaf == "weight" and fmt in _INT and t.dtype == torch.int8):
            parts.setdefault(module, {})[leaf] = t
        elif leaf in ("input_scale", "input_zero_point"):
            continue  # static activation quantization: weight-only kernels keep activations in the compute dtype
        else:
            yield name, t
    for module, p in parts.items():
        yield f"{module}.weight", _decode(module, p, fmt, bits, label)


def _decode(module: str, p: dict[str, torch.Tensor], fmt: str, bits: int, label: str) -> QuantizedWeight:
    def fail(what: str) -> CompressedTensorsError:
        return CompressedTensorsError(f"tensor {module!r} ({label}): {what}")

    if "weight_g_idx" in p:
        raise fail("activation-ordered groups (weight_g_idx) are not supported")
    if "weight_scale" not in p:
        raise fail("weight_scale is missing")
    if fmt == _PACKED:
        if "weight_packed" not in p or "weight_shape" not in p:
            raise fail("weight_packed or weight_shape is missing")
        n, k = (int(x) for x in p["weight_shape"].flatten().tolist())
        packed = p["weight_packed"]
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // (32 // bits))):
            raise fail(f"weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 "
                       f"({n}, {-(-k // (32 // bits))}) for weight_shape [{n}, {k}]")
        q = unpack_int32(packed, bits, k)
    else:
        if "weight" not in p:
            raise fail("the int8 weight is missing")
        q = p["weight"]
        n, k = q.shape
    scale = p["weight_scale"].float()
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)                                  # tensor strategy
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] < 1 or k % scale.shape[1]:
        raise fail(f"weight_scale has shape {tuple(p['weight_scale'].shape)}, which does not divide weight [{n}, {k}]")
    if not bool(torch.isfinite(scale).all()):
        raise fail("weight_scale has non-finite values")
    zero = None
    zp = p.get("weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        if tuple(zp.shape) != tuple(scale.shape) or zp.dtype == torch.int32:
            raise fail(f"packed or mis-shaped weight_zero_point {tuple(zp.shape)} is not supported")
        zero = -scale * zp.float()                                                # scale * (q - zp)
    return QuantizedWeight(q.contiguous(), scale.contiguous(), zero, k // scale.shape[1], bits, label)
