"""The AMX bf16 linear kernel (kernels/amx_linear.py) against float64 and oneDNN's packed linear on the same inputs,
over all of its paths (up to 16 rows: one row tile per column block; more: 2 x 2 tiles per column block pair, an odd
block left over alone; 17-31 rows read in place, the last row tile short) and every padding (rows, K, columns, an odd number of column blocks per thread): bit-equal to oneDNN up to 32 rows, where
the engine uses it; bad shapes are errors; the bf16 engine packs every dense linear for it (``PDSERVE_CPU_AMX_LINEAR=0``
keeps oneDNN, float32 neither), runs its decode steps on it and its greedy choices agree with oneDNN's,
teacher-forced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import amx_linear
from pdserve.kernels.packed_linear import PackedLinear, pack_linears
from tests.support.forced_sampler import MODULES, PROMPTS, agreement, drain, forced_greedy_runs

BUILD = amx_linear.load_extension()
needs_amx = pytest.mark.skipif(BUILD is not None, reason=f"kernel not usable here: {BUILD}")


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,n,k", [(1, 72, 40), (5, 960, 576), (16, 576, 1536), (17, 100, 576), (24, 48, 1536),
                                   (31, 112, 64), (32, 100, 576), (33, 100, 576), (64, 3072, 576), (65, 112, 64), (130, 49152, 576)])
def test_kernel_matches_float64_and_onednn(m, n, k, threads):
    """The kernel itself, at any row count: within a bf16 rounding of the exact product; oneDNN's output but for a
    few elements (none up to 32 rows, where ``AmxLinear`` uses it: its output is oneDNN's, bit for bit)."""
    w, x, b = _bf16(n, k, seed=1, scale=0.05), _bf16(m, k, seed=2), _bf16(n, seed=3)
    packed = torch.ops.pdserve_amx_linear.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (None, b):
            got = torch.ops.pdserve_amx_linear.linear(x, packed, bias, n)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            # float32 sums, one bf16 rounding: within a bf16 step of the exact value (plus float32 summation error)
            assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4 * k ** 0.5).all()
            onednn = PackedLinear(w, bias)(x)
            assert (got != onednn).float().mean() <= 1e-3
            if m <= amx_linear.MAX_ROWS:
                assert torch.equal(got, onednn) and torch.equal(amx_linear.AmxLinear(w, bias)(x), onednn)
    finally:
        torch.set_num_threads(before)


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (48, 1536), (17, 33), (5, 7), (33, 64), (16, 31)])
def test_pack_is_the_documented_layout(n, k):
    """Whole tiles go through a register transpose, partial ones (the last rows or K) element by element: both give
    the layout the kernel reads, (N/16, K/32, 16, 32) with tile row r holding each column's pair (w[n][k0 + 2r],
    w[n][k0 + 2r + 1]), zero-padded."""
    w = _bf16(n, k, seed=7)
    nb, kb = -(-n // 16), -(-k // 32)
    want = torch.zeros(nb * 16, kb * 32, dtype=torch.bfloat16)
    want[:n, :k] = w
    want = want.view(nb, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, kb, 16, 32)
    assert torch.equal(torch.ops.pdserve_amx_linear.pack(w), want)


@needs_amx
@pytest.mark.parametrize("m,n,k", [(24, 3072, 576), (32, 576, 1536), (32, 100, 576), (17, 48, 576), (1, 3072, 576)])
def test_the_threads_split_of_the_column_blocks_changes_no_bit(m, n, k):
    """From 17 rows the threads take the last quarter of the column blocks as they get free (an odd one last, on
    its own): every split, from one thread to more threads than blocks, gives oneDNN's output bit for bit."""
    w, x = _bf16(n, k, seed=4, scale=0.05), _bf16(m, k, seed=5)
    packed, want = torch.ops.pdserve_amx_linear.pack(w), PackedLinear(w, None)(x)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5, 8):
            torch.set_num_threads(threads)
            for _ in range(3):
                assert torch.equal(torch.ops.pdserve_amx_linear.linear(x, packed, None, n), want), threads
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_batched_and_strided_input():
    w, b = _bf16(96, 64, seed=4), _bf16(96, seed=5)
    x3 = _bf16(2, 7, 128, seed=6)[..., ::2]
    torch.testing.assert_close(amx_linear.AmxLinear(w, b)(x3), F.linear(x3, w, b), rtol=1e-2, atol=2e-2)
    assert amx_linear.AmxLinear(w, b)(x3[:, :0]).shape == (2, 0, 96)


@needs_amx
@pytest.mark.parametrize("m,k", [(1, 576), (17, 576), (24, 40), (40, 1536)])
def test_row_strided_input_is_read_in_place(m, k):
    """A view of the first k columns of wider rows (rows padded to whole tiles by plain copies): the same bits as its
    contiguous copy, and as oneDNN's up to 32 rows."""
    w, b = _bf16(200, k, seed=7, scale=0.05), _bf16(200, seed=8)
    packed = torch.ops.pdserve_amx_linear.pack(w)
    view = _bf16(m, k + 24, seed=9)[:, :k]
    assert view.stride() == (k + 24, 1)
    for bias in (None, b):
        got = torch.ops.pdserve_amx_linear.linear(view, packed, bias, 200)
        assert torch.equal(got, torch.ops.pdserve_amx_linear.linear(view.contiguous(), packed, bias, 200))
        if m <= amx_linear.MAX_ROWS:
            assert torch.equal(got, PackedLinear(w, bias)(view.contiguous()))


@needs_amx
@pytest.mark.parametrize("m", [1, 7, 16, 24, 32, 40])
def test_linear_blocks_gives_those_columns_of_the_full_product(m):
    """``linear_blocks`` reads the named column blocks in place (any order, repeats, none): exactly the full product's
    columns for them, at every row count and thread split; a block outside the weight is an error."""
    w, x = _bf16(200, 576, seed=10, scale=0.05), _bf16(m, 576, seed=11)
    packed = torch.ops.pdserve_amx_linear.pack(w)
    full = torch.ops.pdserve_amx_linear.linear(x, packed, None, 208)          # 13 blocks, the last one padded
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for blocks in ([12, 0, 5, 5, 3], [7], list(range(13))[::-1], []):
                got = torch.ops.pdserve_amx_linear.linear_blocks(x, packed, torch.tensor(blocks, dtype=torch.long))
                want = full.view(m, 13, 16)[:, blocks].reshape(m, 16 * len(blocks))
                assert torch.equal(got, want), (threads, blocks)
    finally:
        torch.set_num_threads(before)
    for bad in ([13], [-1], [0.0]):
        with pytest.raises(RuntimeError):
            torch.ops.pdserve_amx_linear.linear_blocks(x, packed, torch.tensor(bad))


@needs_amx
def test_bad_shapes_are_errors():
    w = _bf16(40, 64)
    packed = torch.ops.pdserve_amx_linear.pack(w)
    for x, bias, n in ((_bf16(3, 65), None, 40), (_bf16(3, 64).float(), None, 40), (_bf16(3, 64), _bf16(39), 40),
                       (_bf16(3, 64), None, 60)):
        with pytest.raises(RuntimeError):
            torch.ops.pdserve_amx_linear.linear(x, packed, bias, n)
    with pytest.raises(RuntimeError):
        torch.ops.pdserve_amx_linear.pack(w.float())


@needs_amx
def test_pack_linears_picks_amx_for_bf16_only(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 8, bias=False))
    x = _bf16(5, 64)
    for dtype, env, kind in ((torch.bfloat16, "1", amx_linear.AmxLinear), (torch.bfloat16, "0", PackedLinear),
                             (torch.float16, "1", PackedLinear)):
        monkeypatch.setenv("PDSERVE_CPU_AMX_LINEAR", env)
        m = torch.nn.Sequential(*(torch.nn.Linear(l.in_features, l.out_features, bias=l.bias is not None)
                                  for l in model)).to(dtype)
        m.load_state_dict(model.to(dtype).state_dict())
        want = m(x.to(dtype))
        assert pack_linears(m, torch.device("cpu"), dtype) == 2 and all(type(l) is kind for l in m)
        torch.testing.assert_close(m(x.to(dtype)), want, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def greedy_runs():
    """8 prompts' greedy tokens from a bf16 engine on oneDNN's packed linears, then its top-1 choices on the AMX
    kernel over the same contexts; how many AMX linear calls each run made, and a float32 engine's."""
    calls = []   # rows of the calls that ran the AMX kernel
    real = amx_linear.AmxLinear.forward

    def counted(self, x):
        if (rows := x.numel() // x.shape[-1]) <= amx_linear.MAX_ROWS:
            calls.append(rows)
        return real(self, x)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(amx_linear.AmxLinear, "forward", counted)
        return forced_greedy_runs(
            [(name, {"PDSERVE_CPU_AMX_LINEAR": amx, **MODULES}, {"dtype": dtype}) for name, dtype, amx in
             (("onednn", "bfloat16", "0"), ("amx", "bfloat16", "1"), ("f32", "float32", "1"))],
            PROMPTS, 24, probe=lambda: drain(calls), max_model_len=512, num_gpu_blocks=64)


@needs_amx
def test_engine_runs_it_in_bf16_and_agrees_with_onednn(greedy_runs):
    onednn, onednn_calls = greedy_runs["onednn"]
    amx, amx_calls = greedy_runs["amx"]
    assert onednn_calls == [] and greedy_runs["f32"][1] == []
    # q/k/v, o, gate/up, down in every layer and the LM head, every decode step (8 rows); the prefill's rows: oneDNN
    assert len(amx_calls) >= 23 * (30 * 4 + 1) and set(amx_calls) <= {5, 8}   # 5: the start-up self-check
    same, total = agreement(onednn, amx)
    assert total == 8 * 24 and same / total >= 0.99, f"{same}/{total} positions agree"
