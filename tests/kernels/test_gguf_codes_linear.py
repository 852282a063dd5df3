"""Float32 steps of 1-4 rows on a dense model's GGUF codes (kernels/gguf_codes_linear.py): products within float32
rounding of the dense weight's, only where the codes are the dense weight bit for bit, the codes cached once and
reused, and the engine really runs the default model on them with the same greedy tokens as the dense weights alone.
Exact float32 parity with transformers runs on it through the unchanged parity tests (tests/runtime/test_engine_vs_hf.py)
on CPUs without AVX-512."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import gguf_codes_linear, linear_f32_cpu, small_rows_linear
from pdserve.kernels.gguf_codes_linear import CodesLinear
from pdserve.runtime.quantization import quantize_int4, quantize_int8

CPU = torch.device("cpu")
needs_path = pytest.mark.skipif(not gguf_codes_linear.applies(CPU, torch.float32),
                                reason="float32 steps run on GGUF codes only on CPUs without AVX-512 where the f32_cpu "
                                       "kernel builds (this one has AVX-512, or it is switched off)")
needs_kernel = pytest.mark.skipif(linear_f32_cpu.load_extension() is not None, reason="the f32_cpu kernel cannot build")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 40])
def test_few_rows_on_the_codes_the_rest_dense(rows):
    gen = torch.Generator().manual_seed(rows)
    qw = quantize_int4(torch.randn(960, 576, generator=gen), 32)   # Q4_1's shape: a scale and a minimum per 32
    dense = nn.Linear(576, 960, bias=False)
    dense.weight = nn.Parameter(qw.dequantize(), requires_grad=False)
    layer = CodesLinear.of(dense)
    layer.codes = linear_f32_cpu.F32Linear(qw, None, CPU, torch.float32)
    x = torch.randn(rows, 576, generator=gen)
    before = CodesLinear.served
    y, want = layer(x), F.linear(x, dense.weight)
    assert CodesLinear.served - before == (rows <= 4)
    assert y.shape == want.shape and y.dtype == torch.float32
    ref = x.double() @ dense.weight.double().T   # both within float32 summation of the float64 product
    for out in (y, want):
        assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 5e-6


class _Tiny(nn.Module):
    """What attach needs of a model: its twins (patched in), args, a tied head, linears and an embedding."""

    def __init__(self, twins):
        super().__init__()
        self.args = type("Args", (), {"num_heads": 1, "num_kv_heads": 1})()
        self.embed_tokens = nn.Embedding(64, 32)
        self.a, self.b = nn.Linear(32, 48, bias=False), nn.Linear(32, 16, bias=True)
        self.lm_head, self.head_gemm = None, F.linear
        self.twins = twins

    def quantized_twins(self, weights):
        return self.twins


@needs_path
def test_attached_only_to_bit_exact_twins(monkeypatch, tmp_path):
    gen = torch.Generator().manual_seed(0)
    emb, wa, wb = quantize_int8(torch.randn(64, 32, generator=gen)), *(
        quantize_int4(torch.randn(n, 32, generator=gen), 32) for n in (48, 16))
    model = _Tiny({"embed_tokens": emb, "a": wa, "b": wb})
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb.dequantize())
        model.a.weight.copy_(wa.dequantize())
        model.b.weight.copy_(wb.dequantize())
        model.b.weight[3, 5] = torch.nextafter(model.b.weight[3, 5], torch.tensor(9.0))   # one ulp off: no twin
    monkeypatch.setattr(gguf_codes_linear, "_twins",
                        lambda m, g: {n: q for n, q in m.twins.items() if gguf_codes_linear._exact(m.get_submodule(n), q)})
    assert gguf_codes_linear.attach(model, tmp_path / "x.gguf", CPU, torch.float32) == 1
    assert type(model.a) is CodesLinear and type(model.b) is nn.Linear
    assert isinstance(model.head_gemm, functools.partial)   # the tied head on the embedding's codes
    h = torch.randn(3, 32)
    weight = model.embed_tokens.weight.detach()
    ref = h.double() @ weight.double().T
    assert float((model.head_gemm(h, weight).double() - ref).abs().max() / ref.abs().max()) <= 5e-6
    assert gguf_codes_linear.attach(model, None, CPU, torch.float32) == 0   # no GGUF source: dense alone
    monkeypatch.setenv("PDSERVE_CPU_GGUF_CODES", "0")
    assert not gguf_codes_linear.applies(CPU, torch.float32)


@needs_path
def test_a_gguf_it_cannot_keep_or_a_damaged_cache_is_no_failure(monkeypatch, tmp_path):
    """Blocks pdserve cannot keep (e.g. K-quants): no twins, the dense weights alone, and that answer cached; a damaged
    cache file: the GGUF file read again."""
    from pdserve.runtime import envs, gguf_weights

    gen = torch.Generator().manual_seed(1)
    wa = quantize_int4(torch.randn(48, 32, generator=gen), 32)
    model = _Tiny({"a": wa})
    with torch.no_grad():
        model.a.weight.copy_(wa.dequantize())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(envs, "cache_dir", lambda: tmp_path)
    reads = []

    def refused(path, heads, kv_heads):
        reads.append(path)
        raise gguf_weights.GGUFFormatError("tensor 'blk.0.ffn_down.weight' has GGUF type Q5_K")

    monkeypatch.setattr(gguf_weights, "iter_gguf_weights", refused)
    assert gguf_codes_linear.attach(model, gguf, CPU, torch.float32) == 0 and type(model.a) is nn.Linear
    assert gguf_codes_linear.attach(model, gguf, CPU, torch.float32) == 0 and len(reads) == 1   # the answer cached
    monkeypatch.setattr(gguf_weights, "iter_gguf_weights", lambda path, heads, kv_heads: iter([("a.weight", wa)]))
    for cached in tmp_path.glob("models/*.codes.safetensors"):
        cached.write_bytes(b"not a safetensors file")
    assert gguf_codes_linear.attach(model, gguf, CPU, torch.float32) == 1 and type(model.a) is CodesLinear


@needs_path
def test_engine_runs_the_default_model_on_its_codes(monkeypatch, tmp_path):
    """Greedy tokens with the codes on and off; the codes really served the 1-4 sequence steps (linears and the tied
    LM head); the twins are checked, cached and read back the same."""
    from pdserve.runtime import envs
    from tests.support.switch_runs import switch_runs

    twins = []

    def probe(llm, served=[CodesLinear.served]):   # calls served since the last probe
        engine, before = llm.engine, served[0]
        served[0] = CodesLinear.served
        if isinstance(engine.model.head_gemm, functools.partial):   # the codes are on: cache them anew, read back
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(envs, "cache_dir", lambda: tmp_path)
                twins.append(gguf_codes_linear._twins(engine.model, engine.model.gguf_source))
                assert list(tmp_path.glob("models/*.codes.safetensors"))
                twins.append(gguf_codes_linear._twins(engine.model, engine.model.gguf_source))
        return (served[0] - before, type(engine.model.layers[0].self_attn.qkv_proj), engine.model.head_gemm,
                engine.weight_bytes)

    runs = switch_runs(monkeypatch, "PDSERVE_CPU_GGUF_CODES", probe)
    (off, (off_served, off_type, off_head, off_bytes)), (on, (on_served, on_type, on_head, on_bytes)) = \
        runs["0"], runs["1"]
    assert off_served == 0 and off_type is not CodesLinear and off_head is small_rows_linear.linear
    assert on_served > 0 and on_type is CodesLinear and isinstance(on_head, functools.partial)
    assert on == off
    # the reported weight bytes count the codes: ~0.75 bytes a decoder weight (Q4_1 as codes, float32 scale, minimum)
    # and ~1.1 an embedding weight (Q8_0), next to 4 bytes a weight dense
    assert 1.15 < on_bytes / off_bytes < 1.40
    made, again = twins
    assert len(made) == 121 and set(made) == set(again)   # 30 layers x 4 fused linears + the embedding
    for name, qw in made.items():
        other = again[name]
        assert torch.equal(qw.q, other.q) and torch.equal(qw.scale, other.scale) and qw.fmt == other.fmt
        assert (qw.zero is None) == (other.zero is None) and (qw.zero is None or torch.equal(qw.zero, other.zero))
