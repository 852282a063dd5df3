"""The ``f32_cpu`` quantized linear (kernels/linear_f32_cpu.py): per weight kind, its output against a float64 product
with the dequantized weight; that float32 activations pick it; that it falls back to ``dequant`` when it cannot build.

Tolerance: max |y - y_ref| <= 5e-6 * max |y_ref|. The weight is exact (codes converted in registers, float32 scales
and zeros), so what remains is float32 summation (measured ~1e-7 .. 8e-7 on these shapes); bf16 rounding, the error
this kernel exists to remove, would be ~1e-3.

Shapes: the default model's (K = 576 hidden, 1536 MLP; N = 192 k/v, 960 fused q/k/v, 3072 fused gate/up) and edges:
one group (K = 32 / 16), N not a multiple of the 16-row thread grain, batch 1, 7 (not a multiple of the kernel's
8-row block, 4 on AVX2) and 32. The first test on a clean cache dir builds the extension (~10-20 s on 2 cores; the portable build another ~10 s).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import linear_f32_cpu
from pdserve.kernels.linear_base import QuantizedWeight, create_linear_method, quantized_linear
from pdserve.runtime.gguf_weights import decode_blocks
from pdserve.runtime.quantization import quantize_int4, quantize_int8

CPU = torch.device("cpu")
TOL = 5e-6


def _gguf(type_name: str, n: int, k: int) -> QuantizedWeight:
    from test_quantization_kernels import _encode

    return decode_blocks(_encode(type_name, n, k, seed=n + k), type_name, (n, k), "t")


def _sym(n: int, k: int, g: int, bits: int) -> QuantizedWeight:
    """Symmetric signed codes, compressed-tensors style: W4A16 (bits 4) / INT8 (bits 8, g = k: per channel)."""
    w = torch.randn(n, k)
    top = 7 if bits == 4 else 127
    scale = (w.view(n, k // g, g).abs().amax(-1) / top).clamp(min=1e-8)
    q = torch.round(w / scale.repeat_interleave(g, 1)).clamp(-top - 1, top).to(torch.int8)
    return QuantizedWeight(q, scale, None, g, bits, f"signed {bits}-bit g{g}")


KINDS = {
    "gguf-q4_0": lambda n, k: _gguf("Q4_0", n, k),
    "gguf-q4_1": lambda n, k: _gguf("Q4_1", n, k),
    "gguf-q8_0": lambda n, k: _gguf("Q8_0", n, k),
    "int4-g128": lambda n, k: quantize_int4(torch.randn(n, k), 128 if k % 128 == 0 else 32),
    "int4-g32": lambda n, k: quantize_int4(torch.randn(n, k), 32),
    "int4-channel": lambda n, k: quantize_int4(torch.randn(n, k), k),
    "w4a16-g64": lambda n, k: _sym(n, k, 64 if k % 64 == 0 else 32, 4),
    "int8-channel": lambda n, k: quantize_int8(torch.randn(n, k)),
    "ct-int8-channel": lambda n, k: _sym(n, k, k, 8),
}
SHAPES = [(192, 576), (960, 576), (3072, 576), (576, 1536), (17, 32), (1, 64)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_matches_float64_reference(kind, n, k):
    torch.manual_seed(n * k)
    w = KINDS[kind](n, k)
    bias = torch.randn(n)
    layer = quantized_linear(w, bias, CPU, torch.float32, "t")
    assert type(layer).__name__ == "F32Linear", "float32 activations on CPU must run on f32_cpu"
    ref_w = w.dequantize().double()
    for m in (1, 7, 32):
        x = torch.randn(2, m, k)  # leading dims are flattened by the module
        ref = x.double() @ ref_w.T + bias.double()
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (2, m, n)
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err <= TOL, f"{kind} ({n}, {k}) batch {m}: relative error {err:.2e}"


def test_eight_bit_group_of_sixteen_and_unsigned_codes():
    n, k = 40, 48
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    w = QuantizedWeight(q, torch.rand(n, 3) * 1e-2, torch.randn(n, 3) * 0.1, 16, 8, "uint8 g16")
    layer = quantized_linear(w, None, CPU, torch.float32, "t")
    x = torch.randn(7, k)
    ref = x.double() @ w.dequantize().double().T
    assert type(layer).__name__ == "F32Linear"
    assert float((layer(x).double() - ref).abs().max() / ref.abs().max()) <= TOL


def test_q8_0_codes_are_shared_not_copied():
    """A tied LM head reads the Q8_0 embedding's own tensors (what keeps the default model >= 4x smaller)."""
    w = _gguf("Q8_0", 64, 576)
    layer = quantized_linear(w, None, CPU, torch.float32, "t")
    assert layer.codes.data_ptr() == w.q.data_ptr() and layer.scale.data_ptr() == w.scale.data_ptr()


def test_shapes_it_cannot_take_fall_to_dequant():
    w = QuantizedWeight(torch.zeros(8, 40, dtype=torch.uint8), torch.ones(8, 2), None, 20, 4, "odd")
    assert "multiple of 32" in create_linear_method("f32_cpu").supports(w, CPU, torch.float32)
    assert type(quantized_linear(w, None, CPU, torch.float32, "t")).__name__ == "DequantLinear"
    w4 = quantize_int4(torch.randn(16, 64), 32)
    assert type(quantized_linear(w4, None, CPU, torch.bfloat16, "t")).__name__ == "Int4Linear"  # bf16: torch's kernel
    w4 = quantize_int4(torch.randn(8, 64), 32)  # torch's int4 packer needs N % 16: a clear error, not its RuntimeError
    with pytest.raises(ValueError, match="int4_cpu: needs out_features divisible by 16"):
        quantized_linear(w4, None, CPU, torch.bfloat16, "t")


def test_linear_method_override(monkeypatch):
    w = quantize_int4(torch.randn(8, 64), 32)
    monkeypatch.setenv("PDSERVE_LINEAR_METHOD", "dequant")
    assert type(quantized_linear(w, None, CPU, torch.float32, "t")).__name__ == "DequantLinear"
    monkeypatch.setenv("PDSERVE_LINEAR_METHOD", "f32_cpu")
    with pytest.raises(ValueError, match=r"'model\.x\.weight'.*f32_cpu: float32 activations only"):
        quantized_linear(w, None, CPU, torch.bfloat16, "model.x.weight")
    monkeypatch.setenv("PDSERVE_LINEAR_METHOD", "fp3")
    with pytest.raises(ValueError, match="unknown quantized linear method 'fp3'"):
        quantized_linear(w, None, CPU, torch.float32, "t")


def test_a_failing_build_is_a_reason_not_a_crash(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    reason = linear_f32_cpu.build("#error no compiler here\n", ["-O3"])
    assert reason is not None and "could not be built" in reason
    assert "fall back to dequant" in caplog.text
    monkeypatch.setattr(linear_f32_cpu, "load_extension", lambda: reason)  # what the registry then sees
    w = quantize_int4(torch.randn(8, 64), 32)
    assert type(quantized_linear(w, None, CPU, torch.float32, "t")).__name__ == "DequantLinear"


def test_build_is_keyed_and_cached():
    """Built into the cache dir under a name hashing source, torch version, flags; a second load does not rebuild."""
    from pdserve.runtime import envs

    assert linear_f32_cpu.load_extension() is None
    builds = list((envs.cache_dir() / "torch_extensions").glob("pdserve_qf32_*/pdserve_qf32_*.so"))
    assert builds, "the extension is built under PDSERVE_CACHE_DIR/torch_extensions"
    mtime = {p: p.stat().st_mtime for p in builds}
    assert linear_f32_cpu.build(linear_f32_cpu.SOURCE, linear_f32_cpu._cflags()) is None
    assert {p: p.stat().st_mtime for p in builds} == mtime


PORTABLE = """
import sys, torch
from pdserve.kernels import linear_f32_cpu as m
from pdserve.kernels.linear_base import QuantizedWeight
from pdserve.runtime.quantization import quantize_int4, quantize_int8
m._cflags = lambda: sys.argv[1:]  # no -mavx512*: __AVX512F__ undefined; the AVX2 path or the portable C++ loop
assert m.load_extension() is None
print(torch.ops.pdserve_qf32.isa())
torch.manual_seed(0)
w = torch.randn(40, 576)
sc = w.view(40, 9, 64).abs().amax(-1) / 7
q = torch.round(w / sc.repeat_interleave(64, 1)).clamp(-8, 7).to(torch.int8)
worst = 0.0
for qw in (quantize_int4(w, 32), quantize_int4(w, 576), quantize_int8(w), QuantizedWeight(q, sc, None, 64, 4, "s")):
    layer = m.F32Linear(qw, None, torch.device("cpu"), torch.float32)
    for rows in (1, 7, 9):
        x = torch.randn(rows, 576)
        ref = x.double() @ qw.dequantize().double().T
        worst = max(worst, float((layer(x).double() - ref).abs().max() / ref.abs().max()))
print(worst)
"""


@pytest.mark.parametrize("flags, isa", [(["-O3"], "portable"), (["-O3", "-mavx2", "-mfma"], "avx2")])
def test_other_vector_paths_build_and_match(flags, isa):
    """The paths a CPU without AVX-512 runs, each built in a child process (one op library a process): the plain loop
    and, on any CPU with AVX2 + FMA, the AVX2 path (e.g. AMD Zen 2/3)."""
    import subprocess
    import sys

    from pdserve.runtime.cpu_features import cpu_flags

    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    out = subprocess.run([sys.executable, "-c", PORTABLE, *flags], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    built, worst = out.stdout.split()[-2:]
    assert built == isa and float(worst) <= TOL


def test_default_build_takes_the_widest_vector_path_the_cpu_has():
    from pdserve.runtime.cpu_features import cpu_flags

    assert linear_f32_cpu.load_extension() is None
    flags = cpu_flags()
    want = "avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    assert torch.ops.pdserve_qf32.isa() == want
