"""One LoRA adapter read from a PEFT directory, validated against the base model, with a digest of its weights.

Format (what ``peft.PeftModel.save_pretrained`` writes): ``adapter_config.json`` + ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.lora_{A,B}.weight`` tensors, A
``(r, in)`` and B ``(out, r)``. The delta of a targeted projection is ``(x @ A.T @ B.T) * scaling`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``; ``alpha_pattern``/``rank_pattern`` per module).

Everything that the batched kernel cannot run exactly is refused with a :class:`LoRAError` naming the reason (the
server turns it into a 400): pickled ``.bin`` weights, DoRA, trained biases, ``modules_to_save``, other target modules
(embeddings, LM head), ranks above ``max_lora_rank``, shapes that do not fit the base model, an A without its B.

The digest (SHA-256 over every tensor's name, shape and bytes and every scaling) is the adapter's identity for the
prefix cache and for P/D handoffs: reloading other weights under the same name gives another digest, so stale KV can
never be served.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# PEFT projection name -> (our fused module, shard index in it); see runtime/models/llama.py (_FUSED)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?"
                  r"\.weight$")
MAX_CONFIG_BYTES = 1 << 20


class LoRAError(ValueError):
    """An adapter that cannot be served; the message says why (shown to the client as a 400)."""


@dataclass(frozen=True)
class ProjShapes:
    """(in, out) of every PEFT projection of the base model, and its layer count."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_model(cls, model) -> "ProjShapes":
        a = model.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        h, m = a.hidden_size, a.intermediate_size
        return cls(a.num_layers, {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                                  "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)})


@dataclass
class LoRAWeights:
    a: torch.Tensor      # (r, in) float32
    b: torch.Tensor      # (out, r) float32
    scaling: float


@dataclass
class LoRAAdapter:
    """A loaded adapter (CPU, float32). ``weights[(layer, proj)]`` for every targeted projection of every layer."""

    name: str
    path: str
    weights: dict[tuple[int, str], LoRAWeights]
    rank: int                      # the largest rank of any module
    digest: str                    # hex SHA-256 of weights + scalings: the cache identity
    base_model_name: str | None = None
    int_id: int = 0                # unique per load (set by the manager): names slots and requests
    ref_count: int = field(default=0, compare=False)  # unfinished requests using it (never evicted while > 0)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's per-module override lookup: a key matches a module whose dotted name ends with it (or a regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def load_adapter(name: str, path: str | Path, shapes: ProjShapes, max_lora_rank: int) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory ``path``; raises :class:`LoRAError` with the reason."""
    from safetensors import SafetensorError, safe_open

    root = Path(path)
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory")
    cfg_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {str(path)!r}")
    if not weights_file.is_file():
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            raise LoRAError(f"LoRA adapter {name!r}: only pickled weights (.bin/.pt) found; pdserve never unpickles "
                            "files, save the adapter with safe_serialization=True (adapter_model.safetensors)")
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {str(path)!r}")
    try:
        if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError("file too large")
        cfg = json.loads(cfg_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: unreadable adapter_config.json: {e}") from e
    _check_config(name, cfg)
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError, RuntimeError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: corrupt adapter_model.safetensors: {e}") from e

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: unsupported tensor {key!r}; only lora_A/lora_B of "
                            f"{sorted(TARGETS)} in the decoder layers can be served")
        layer, proj, ab = int(m.group(1)), m.group(3), m.group(4)
        if proj not in TARGETS or not (m.group(2) == "mlp") == (proj in ("gate_proj", "up_proj", "down_proj")):
            raise LoRAError(f"LoRA adapter {name!r}: unsupported target module {proj!r} in {key!r}; supported: "
                            f"{sorted(TARGETS)}")
        if layer >= shapes.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key!r} names layer {layer}, the base model has "
                            f"{shapes.num_layers}")
        pairs.setdefault((layer, proj), {})[ab] = t

    alpha, r_default = float(cfg.get("lora_alpha", 8)), int(cfg.get("r", 8))
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"].float().contiguous(), ab["B"].float().contiguous()
        fan_in, fan_out = shapes.shapes[proj]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the base model needs A (r, {fan_in}) and B ({fan_out}, r): it was "
                            "trained for another base model")
        if r < 1 or r > max_lora_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {r} of layer {layer} {proj} exceeds --max-lora-rank "
                            f"{max_lora_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {proj} has non-finite weights")
        module = f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
        r_cfg = int(_pattern_value(cfg.get("rank_pattern"), module, r_default))
        if r_cfg != r:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {proj} has rank {r}, adapter_config.json says "
                            f"{r_cfg}")
        a_m = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        scaling = a_m / math.sqrt(r) if cfg.get("use_rslora") else a_m / r
        weights[(layer, proj)] = LoRAWeights(a, b, scaling)
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(root), weights=weights, rank=max(w.a.shape[0] for w in weights.values()),
                       digest=weights_digest(weights))


def _check_config(name: str, cfg: dict) -> None:
    def bad(why: str) -> LoRAError:
        return LoRAError(f"LoRA adapter {name!r}: {why}")

    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise bad("DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"trained biases (bias={cfg.get('bias')!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise bad(f"modules_to_save {cfg['modules_to_save']!r} (fully trained modules) are not supported")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out (Conv1D layouts) is not supported for the Llama family")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        extra = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
        if extra:
            raise bad(f"unsupported target modules {extra}; supported: {sorted(TARGETS)}")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key, 8)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise bad(f"{key} must be a positive number, got {v!r}")


def weights_digest(weights: dict[tuple[int, str], LoRAWeights]) -> str:
    h = hashlib.sha256(b"pdserve-lora-v1")
    for (layer, proj), w in sorted(weights.items()):
        h.update(f"{layer}.{proj}:{tuple(w.a.shape)}:{tuple(w.b.shape)}:{w.scaling!r}".encode())
        h.update(w.a.numpy().tobytes())
        h.update(w.b.numpy().tobytes())
    return h.hexdigest()
