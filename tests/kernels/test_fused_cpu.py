"""The fused bf16 CPU elementwise ops (kernels/fused_cpu.py) against the eager torch chains they replace, on the same
inputs: the residual add and RoPE bit for bit; RMSNorm and SiLU * up equal but for one bf16 rounding on a few elements
(RMSNorm's mean is summed in another order, SiLU's exp is not Sleef's; the bf16 engine's agreement with transformers,
tests/runtime/test_dtype_default.py, depends on how few); bad shapes are errors; the bf16 engine runs them (and
float32 does not) and its greedy choices agree with the eager path's, teacher-forced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import fused_cpu
from pdserve.runtime.models.llama import RMSNorm, rotate_half
from tests.support.forced_sampler import MODULES, PROMPTS, agreement, drain, forced_greedy_runs

BUILD = fused_cpu.load_extension()
needs_ops = pytest.mark.skipif(BUILD is not None, reason=f"ops not built here: {BUILD}")


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _assert_nearly_equal(got, want, max_frac=1e-3):
    """Equal, but for at most ``max_frac`` of the elements, each off by at most one bf16 rounding."""
    differ = got != want
    assert differ.float().mean() <= max_frac
    step = want.float().abs() * 2 ** -7 + 1e-30            # one bf16 step at that magnitude, with margin
    assert ((got.float() - want.float()).abs()[differ] <= 2 * step[differ]).all()


def _norm(n):
    norm = RMSNorm(n, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(_bf16(n, seed=9).abs() + 0.5)
    return norm


@needs_ops
@pytest.mark.parametrize("rows,n", [(1, 576), (7, 64), (300, 576), (33, 2048)])
def test_rms_norm_and_residual_add(monkeypatch, rows, n):
    x, res = _bf16(rows, n, seed=1, scale=3), _bf16(rows, n, seed=2)
    norm = _norm(n)
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "1")
    got, got_add = norm(x), norm.add_forward(x, res)
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "0")
    want, want_add = norm(x), norm.add_forward(x, res)
    _assert_nearly_equal(got, want, 1e-2)
    assert torch.equal(got_add[1], res + x)
    _assert_nearly_equal(got_add[0], want_add[0], 1e-2)
    assert torch.equal(res, _bf16(rows, n, seed=2))     # the residual input is not written


@needs_ops
def test_rope_on_the_qkv_view_bit_for_bit():
    t, d = 45, 64
    qkv = _bf16(t, 15 * d, seed=3, scale=2)
    qk = qkv[:, :12 * d].view(t, 12, d)                  # rows strided by the fused qkv width, as in the model
    cos, sin = _bf16(t, 2, d, seed=4).unbind(1)
    cos, sin = cos[:, None], sin[:, None]
    got = torch.ops.pdserve_fused_cpu.rope(qk, cos, sin)
    assert torch.equal(got, qk * cos + rotate_half(qk) * sin)


@needs_ops
def test_silu_mul_within_one_rounding():
    gate_up = _bf16(200, 2 * 1536, seed=5, scale=4)
    got = torch.ops.pdserve_fused_cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_nearly_equal(got, F.silu(gate).mul_(up), 1e-4)   # a reciprocal estimate for the division: ~1e-3


@needs_ops
def test_argmax_is_torchs_answer():
    """Random rows, rows of ties (the first maximum wins), -inf rows (masked out: index 0), NaNs (the first NaN wins, as
    torch's argmax propagates them), widths that are not a multiple of 16, a strided row view, one row."""
    gen = torch.Generator().manual_seed(0)
    for n, v in ((32, 49152), (5, 17), (3, 1), (1, 1000), (7, 33)):
        x = torch.randn(n, v, generator=gen)
        x[0] = float("-inf")
        if n > 1:
            x[1] = x[1].round()                    # many equal values: ties for the maximum
        if n > 2:
            x[2, v // 2:] = float("nan")
        if n > 3:
            x[3] = 7.0
            x[3, v - 1] = 8.0
        got = torch.ops.pdserve_fused_cpu.argmax(x)
        assert torch.equal(got, x.argmax(dim=-1)), (n, v)
        assert torch.equal(fused_cpu.argmax(x[:, : max(1, v // 2)]), x[:, : max(1, v // 2)].argmax(dim=-1))
    assert torch.equal(fused_cpu.argmax(x.double()), x.double().argmax(dim=-1))   # other dtypes: torch's
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pdserve_fused_cpu.argmax(torch.zeros(2, 0))


@needs_ops
def test_bad_shapes_are_errors():
    ops = torch.ops.pdserve_fused_cpu
    with pytest.raises(RuntimeError, match="bf16"):
        ops.rms_norm(torch.randn(4, 64), None, torch.ones(64).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(_bf16(4, 64), None, torch.ones(32).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        ops.rms_norm(_bf16(4, 64), _bf16(5, 64), torch.ones(64).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="cos/sin"):
        ops.rope(_bf16(4, 3, 64), _bf16(4, 1, 32), _bf16(4, 1, 32))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.silu_mul(_bf16(4, 48))


def test_switch_dtype_and_widths(monkeypatch):
    x = _bf16(2, 64)
    monkeypatch.setenv("PDSERVE_CPU_FUSED_ELEMENTWISE", "0")
    assert not fused_cpu.enabled(x)
    monkeypatch.delenv("PDSERVE_CPU_FUSED_ELEMENTWISE")
    assert fused_cpu.enabled(x) is (BUILD is None)
    assert not fused_cpu.enabled(x.float())                 # float32 keeps transformers' eager numerics
    assert not fused_cpu.enabled(_bf16(2, 48), 32)
    monkeypatch.setattr(fused_cpu, "load_extension", lambda: "no compiler")
    assert not fused_cpu.enabled(x)


@pytest.fixture(scope="module")
def greedy_runs():
    """8 prompts' greedy tokens from a bf16 engine on the eager ops, then its top-1 choices with the fused ops on the
    same contexts; counts of fused calls (what ``enabled`` granted) per run, and a float32 engine's count."""
    granted = []
    real = fused_cpu.enabled
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused_cpu, "enabled", lambda *a: (real(*a) and granted.append(1)) or real(*a))
        return forced_greedy_runs(
            [(name, {"PDSERVE_CPU_FUSED_ELEMENTWISE": fused, **MODULES}, {"dtype": dtype}) for name, dtype, fused in
             (("eager", "bfloat16", "0"), ("fused", "bfloat16", "1"), ("f32", "float32", "1"))],
            PROMPTS, 24, probe=lambda: len(drain(granted)),
            max_model_len=512, num_gpu_blocks=64)


@needs_ops
def test_engine_runs_them_in_bf16_and_agrees_with_eager(greedy_runs):
    eager, eager_calls = greedy_runs["eager"]
    fused, fused_calls = greedy_runs["fused"]
    assert eager_calls == 0 and greedy_runs["f32"][1] == 0
    assert fused_calls >= 24 * 30 * 4       # norm, add + norm, RoPE, SiLU in every layer of every step
    same, total = agreement(eager, fused)
    assert total == 8 * 24 and same / total >= 0.99, f"{same}/{total} positions agree"
