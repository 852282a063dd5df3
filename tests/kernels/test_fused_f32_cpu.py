"""The fused float32 CPU elementwise ops (kernels/fused_f32_cpu.py) against the eager chains they replace, bit for bit
(``torch.equal``) on the same inputs, tails and extreme values included, and their transpose against torch's copy; bad shapes are errors; the float32 engine
runs them and its greedy tokens are the eager path's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_cpu, fused_f32_cpu
from pdserve.runtime.models.llama import RMSNorm, rotate_half
from tests.support.switch_runs import switch_runs

BUILD = fused_f32_cpu.load_extension()
pytestmark = pytest.mark.skipif(BUILD is not None, reason=f"ops not built here: {BUILD}")
ops = torch.ops.pdserve_fused_f32_cpu


def _f32(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows,n", [(1, 576), (7, 64), (300, 576), (33, 2048), (5, 4096), (3, 40), (9, 100), (2, 3)])
def test_rms_norm_and_residual_add_bit_for_bit(monkeypatch, rows, n):
    """Widths with every part of torch's summation order: one level of 16 vector quads and more (2,048, 4,096),
    leftover vectors (40: five 8-lane vectors), a scalar tail (100, 3)."""
    x, res = _f32(rows, n, seed=1, scale=3), _f32(rows, n, seed=2)
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(_f32(n, seed=9).abs() + 0.5)
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "0")
    want, (want_add, want_sum) = norm(x), norm.add_forward(x, res)
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "1")
    assert fused_cpu.ops_for(x) is ops
    got, (got_add, got_sum) = norm(x), norm.add_forward(x, res)
    assert torch.equal(got, want) and torch.equal(got_add, want_add) and torch.equal(got_sum, want_sum)
    assert torch.equal(res, _f32(rows, n, seed=2))     # the residual input is not written


def test_rope_on_the_qkv_view_bit_for_bit():
    for t, d in ((45, 64), (1, 128), (3, 6)):
        qkv = _f32(t, 15 * d, seed=3, scale=2)
        qk = qkv[:, :12 * d].view(t, 12, d)                # rows strided by the fused qkv width, as in the model
        cos, sin = _f32(t, 2, d, seed=4).unbind(1)
        cos, sin = cos[:, None], sin[:, None]
        assert torch.equal(ops.rope(qk, cos, sin), qk * cos + rotate_half(qk) * sin)


@pytest.mark.parametrize("rows,width", [(1, 1536), (9, 1536), (300, 1536), (4, 20), (3, 37), (2, 100)])
def test_silu_mul_bit_for_bit(rows, width):
    """Whole vector pairs (SLEEF's expf, as torch's vector loop) and a row's scalar tail (the C library's, as torch's)."""
    gate_up = torch.cat([_f32(rows, width, seed=5, scale=4), _f32(rows, width, seed=6)], 1)
    gate_up[0, :8] = torch.tensor([-100.0, 100.0, -88.5, 89.0, float("inf"), float("-inf"), 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = ops.silu_mul(gate_up), F.silu(gate).mul_(up)
    assert want[0, 5].isnan() and torch.equal(got.view(torch.int32), want.view(torch.int32))   # NaN's bits too


@pytest.mark.parametrize("n,t", [(576, 32), (3072, 9), (960, 31), (49152, 2), (13, 5), (8, 8), (7, 33), (1, 1)])
def test_transpose_is_torchs_copy(n, t):
    """The small-rows product's way back, ``(W X^T)^T``: 8 x 8 tiles, ragged edges on both sides; NaN, infinities and
    -0 keep their bits."""
    r = _f32(n, t, seed=n + t)
    r.view(-1)[::7] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).repeat(r.numel() // 28 + 1)[
        :len(r.view(-1)[::7])]
    got, want = ops.transpose(r, t), r.t().contiguous()
    assert got.shape == (t, n) and got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(fused_f32_cpu.transposed(r).view(torch.int32), want.view(torch.int32))
    for cols in {0, t // 2, t - 1} - {t}:   # only the first columns (the small rows' padding dropped)
        got, want = fused_f32_cpu.transposed(r, cols), r[:, :cols].t().contiguous()
        assert got.shape == (cols, n) and got.is_contiguous()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_bad_shapes_are_errors():
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.randn(4, 64).bfloat16(), None, torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(4, 64), None, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        ops.rms_norm(torch.randn(4, 64), torch.randn(5, 64), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        ops.rope(torch.randn(4, 3, 64), torch.randn(4, 1, 32), torch.randn(4, 1, 32))
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.randn(4, 47))
    for bad in (torch.randn(4, 8).t(), torch.randn(4, 8).bfloat16(), torch.randn(2, 4, 8)):
        with pytest.raises(RuntimeError, match="contiguous float32"):
            ops.transpose(bad, 1)
    for cols in (-1, 9):
        with pytest.raises(RuntimeError, match="cols"):
            ops.transpose(torch.randn(4, 8), cols)


def test_switch_and_dtype(monkeypatch):
    x = torch.randn(2, 64)
    assert fused_f32_cpu.enabled(x) and not fused_f32_cpu.enabled(x.bfloat16())
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "0")
    assert not fused_f32_cpu.enabled(x) and fused_cpu.ops_for(x) is None
    monkeypatch.delenv("PDSERVE_CPU_FUSED_ELEMENTWISE")
    monkeypatch.setattr(fused_f32_cpu, "load_extension", lambda: "no compiler")
    assert not fused_f32_cpu.enabled(x)
    assert torch.equal(fused_f32_cpu.transposed(x), x.t().contiguous())   # torch's copy where the ops do not serve


def test_float32_engine_runs_them_and_keeps_its_tokens(monkeypatch):
    """The modules' path (the float32 layer stack, which calls the same ops, has its own test)."""
    monkeypatch.setenv("PDSERVE_CPU_LAYER_STACK", "0")
    calls = []
    real = fused_f32_cpu.enabled
    monkeypatch.setattr(fused_f32_cpu, "enabled", lambda x: (real(x) and calls.append(1)) or real(x))

    def served(llm):
        n = len(calls)
        calls.clear()
        return n

    runs = switch_runs(monkeypatch, "PDSERVE_CPU_FUSED_ELEMENTWISE", served)
    assert runs["0"][1] == 0
    assert runs["1"][1] >= 16 * 30 * 4      # norm, add + norm, RoPE, SiLU in every layer of every step
    assert runs["1"][0] == runs["0"][0]
