"""``--quantization``: the flag reaches the engine config, the plan per checkpoint kind, the compute dtype it implies,
and the ``pdserve:model_weight_bytes`` gauge."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.runtime.cli import add_parser, engine_options
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.metrics import ServerMetrics, parse_samples
from pdserve.runtime.model_loader import resolve_dtype
from pdserve.runtime.quantization import plan


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flag_reaches_the_model_config():
    assert EngineConfig.from_options(**engine_options(_parse(["--quantization", "int4"]))).model.quantization == "int4"
    assert EngineConfig.from_options(**engine_options(_parse([]))).model.quantization == "auto"
    with pytest.raises(SystemExit):
        _parse(["--quantization", "fp4"])


def test_plans():
    assert not plan("auto", gguf_source=True, compressed=False).quantized          # the default model: as before
    assert not plan("none", gguf_source=True, compressed=False).quantized
    assert plan("int4", gguf_source=True, compressed=False).source == "gguf"       # Q4_1 blocks kept
    assert plan("int4", gguf_source=False, compressed=False).quantize_at_load == "int4"
    assert plan("int8", gguf_source=True, compressed=False).quantize_at_load == "int8"
    assert plan("auto", gguf_source=False, compressed=True).source == "compressed-tensors"
    assert not plan("none", gguf_source=False, compressed=True).quantized           # dequantized at load
    with pytest.raises(ValueError, match="already quantized"):
        plan("int8", gguf_source=False, compressed=True)
    with pytest.raises(ValueError, match="unknown quantization 'fp3'"):
        plan("fp3", gguf_source=False, compressed=False)


def test_quantized_weights_compute_in_bf16_on_cpu_unless_asked():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", None, cpu, quantized=True) == torch.bfloat16
    assert resolve_dtype("auto", None, cpu, quantized=True, cpu_bf16=None) == torch.bfloat16
    assert resolve_dtype("auto", None, cpu, quantized=False, cpu_bf16=None) == torch.float32  # no AVX512-BF16/AMX
    assert resolve_dtype("float32", None, cpu, quantized=True) == torch.float32


def test_weight_bytes_gauge():
    m = ServerMetrics("m")
    m.set_model_weight_bytes(133_660_000)
    assert parse_samples(m.render().decode())['pdserve:model_weight_bytes{model_name="m"}'] == 133_660_000


def test_weight_bytes_counts_a_shared_tensor_once():
    """The ``dequant`` tied LM head reads the embedding's own codes and scales: one copy in memory, counted once."""
    from torch import nn

    from pdserve.runtime.quantization import weight_bytes

    codes, scale = torch.zeros(64, 32, dtype=torch.int8), torch.ones(64, 1)
    a, b = nn.Module(), nn.Module()
    for m in (a, b):
        m.register_buffer("codes", codes)
        m.register_buffer("scale", scale)
    model = nn.ModuleDict({"embed": a, "head": b, "norm": nn.LayerNorm(32)})
    assert weight_bytes(model) == codes.nbytes + scale.nbytes + 2 * 32 * 4
