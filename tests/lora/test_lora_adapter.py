"""Adapter loading refuses, with the reason, everything the batched kernel cannot serve exactly (no model needed)."""

from __future__ import annotations

import pytest

from pdserve.runtime.lora_adapter import LoRAError, ProjShapes, load_adapter
from tests.support.lora import ADAPTERS, broken_adapters

# SmolLM2-135M: hidden 576, 9 heads x 64, 3 KV heads, intermediate 1536, 30 layers
SHAPES = ProjShapes(30, {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                         "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)})


def test_good_adapters_load_with_scaling_and_digest(adapter_dirs):
    for name, (rank, alpha, targets, rslora) in ADAPTERS.items():
        a = load_adapter(name, adapter_dirs[name], SHAPES, max_lora_rank=64)
        assert a.rank == rank and {p for _, p in a.weights} == set(targets)
        assert len(a.weights) == 30 * len(targets)
        w = next(iter(a.weights.values()))
        assert w.scaling == pytest.approx(alpha / rank ** 0.5 if rslora else alpha / rank)
        assert any(bool(w.b.abs().sum() > 0) for w in a.weights.values())
    a1 = load_adapter("x", adapter_dirs["attn8"], SHAPES, 64)
    a2 = load_adapter("y", adapter_dirs["attn8"], SHAPES, 64)
    b = load_adapter("x", adapter_dirs["mlp16"], SHAPES, 64)
    assert a1.digest == a2.digest != b.digest      # the digest names the weights, not the name


def test_bad_adapters_are_refused_with_the_reason(adapter_dirs, tmp_path):
    for kind, (path, phrase) in broken_adapters(adapter_dirs["attn8"], tmp_path).items():
        with pytest.raises(LoRAError, match=phrase):
            load_adapter(kind, path, SHAPES, max_lora_rank=16)
    with pytest.raises(LoRAError, match="max-lora-rank"):
        load_adapter("small", adapter_dirs["mlp16"], SHAPES, max_lora_rank=8)
    with pytest.raises(LoRAError, match="not a directory"):
        load_adapter("nowhere", tmp_path / "nowhere", SHAPES, max_lora_rank=16)
