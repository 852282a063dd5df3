"""Float32 linears of 1-256 rows on CPUs without AVX-512 (kernels/small_rows_linear.py), on pdserve's own kernel or,
where it cannot build, ``(W X^T)^T``: within float32 rounding of ``F.linear`` (bit-equal where it does not serve) and
of float64, a row's bits independent of the rest of the batch and of the threads, a tall weight's slabs bit-equal to
its whole product, the model's linears swapped without copies where it applies and nowhere else, and the engine
really runs it with the same greedy tokens as ``F.linear``. Exact float32 parity with transformers runs on it through
the unchanged parity tests (tests/runtime/test_engine_vs_hf.py) on such CPUs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import small_rows_linear
from pdserve.kernels.small_rows_linear import SmallRowsLinear, applies, swap_linears

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 40, 128, 129, 256, 257, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_same_products_as_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    dense = nn.Linear(576, 960, bias=bias)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(960, 576, generator=gen) * 0.05)
    layer = SmallRowsLinear(576, 960, bias=bias)
    layer.load_state_dict(dense.state_dict())
    x = torch.randn(rows, 576, generator=gen)
    before = SmallRowsLinear.served
    y, want = layer(x), F.linear(x, dense.weight, dense.bias)
    assert y.shape == want.shape and y.is_contiguous()
    served = small_rows_linear.ROWS if small_rows_linear.load_extension() is None else small_rows_linear.SGEMM_ROWS
    assert served in (range(1, 257), range(2, 129))
    assert SmallRowsLinear.served - before == (rows in served)   # it served exactly those row products
    if rows not in served:
        assert torch.equal(y, want)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y3 = layer(x.view(1, rows, 576))   # leading dims are kept
    assert y3.shape == (1, rows, 960) and torch.equal(y3[0], y)


def test_without_the_kernel_rows_go_to_the_sgemm_padded_to_a_multiple_of_16(monkeypatch):
    """Where the kernel cannot build, above 8 rows MKL's sgemm runs a multiple of 16 columns, zeros past the rows;
    only the rows come back."""
    padded = [small_rows_linear.padded(r) for r in (2, 8, 9, 16, 17, 31, 32, 33, 128)]
    assert padded == [2, 8, 16, 16, 32, 32, 32, 48, 128]
    seen, real = [], small_rows_linear.tall_mm
    monkeypatch.setattr(small_rows_linear, "tall_mm", lambda w, xt: seen.append(xt) or real(w, xt))
    monkeypatch.setattr(small_rows_linear, "load_extension", lambda: "no compiler (test)")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=gen) * 0.05
    for rows in (5, 9, 13, 31, 47):
        x = torch.randn(rows, 576, generator=gen)
        y = small_rows_linear.linear(x, w)
        cols = small_rows_linear.padded(rows)
        assert seen[-1].shape == (576, cols) and not seen[-1][:, rows:].any()
        assert y.shape == (rows, 960) and y.is_contiguous()
        assert torch.equal(y, torch.mm(w, F.pad(x, (0, 0, 0, cols - rows)).t()).t()[:rows])
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    for rows in (1, 129, 200):   # outside the sgemm's rows: F.linear itself
        x = torch.randn(rows, 576, generator=gen)
        assert torch.equal(small_rows_linear.linear(x, w), F.linear(x, w))
    assert len(seen) == 5


KERNEL = pytest.mark.skipif(small_rows_linear.load_extension() is not None, reason="the small-rows kernel needs "
                            "AVX2 + FMA and a compiler")


def _kernel(x, w):
    return torch.ops.pdserve_small_rows_f32_cpu.linear(x, w)


@KERNEL
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (7, 13), (13, 300), (1, 129)])
def test_kernel_within_float32_rounding_of_float64(n, k):
    """Every row count it serves, weights of any height (tiles of 6, ragged last) and K (partial sums of 128, ragged
    last): within a float32 sum's rounding bound of the float64 product."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    for rows in (1, 2, 5, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 128, 200, 256):
        x = torch.randn(rows, k, generator=gen)
        y, ref = _kernel(x, w), x.double() @ w.double().t()
        assert y.shape == (rows, n) and y.is_contiguous()
        bound = (x.double().abs() @ w.double().abs().t()) * (128 + k // 128 + 2) * 2.0 ** -24
        assert ((y.double() - ref).abs() <= bound).all(), rows
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@KERNEL
def test_kernel_rows_do_not_depend_on_the_batch_or_the_threads():
    """A row's output has the same bits whatever rows share its call (the zeros padding its slab, its place in it)
    and on 1 or 2 threads; non-contiguous rows are read in place."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(3072, 576, generator=gen) * 0.05, torch.randn(40, 576, generator=gen)
    y = _kernel(x, w)
    for lo, hi in ((0, 1), (7, 8), (0, 9), (5, 14), (17, 40), (31, 40)):
        assert torch.equal(_kernel(x[lo:hi], w), y[lo:hi]), (lo, hi)
    assert torch.equal(_kernel(torch.cat([x[::2], x[1::2]])[::1], w)[:20], y[::2])
    big = torch.randn(40, 1152, generator=gen)
    assert torch.equal(_kernel(big[:, ::2], w), _kernel(big[:, ::2].contiguous(), w))   # strided x
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_kernel(x, w), y)
    finally:
        torch.set_num_threads(threads)


@KERNEL
def test_kernel_serves_1_to_256_rows_and_bad_shapes_are_errors(monkeypatch):
    """Every row count it serves goes to the kernel (a strided weight to the sgemm); bad shapes raise."""
    calls, real = [], small_rows_linear.tall_mm
    monkeypatch.setattr(small_rows_linear, "tall_mm", lambda w, xt: calls.append(xt.shape[1]) or real(w, xt))
    w = torch.randn(960, 576)
    for rows in (1, 2, 8, 9, 128, 256):
        x = torch.randn(rows, 576)
        assert torch.equal(small_rows_linear.linear(x, w), _kernel(x, w))
    assert calls == []   # MKL's sgemm never ran
    x = torch.randn(257, 576)
    assert torch.equal(small_rows_linear.linear(x, w), F.linear(x, w))   # past 256 rows: F.linear
    strided = torch.randn(576, 960).t()
    small_rows_linear.linear(torch.randn(5, 576), strided)
    assert calls == [5]
    assert torch.equal(_kernel(torch.randn(9, 0), torch.randn(7, 0)), torch.zeros(9, 7))   # empty sums
    for x, w2 in ((torch.randn(9, 576).double(), w), (torch.randn(9, 575), w), (torch.randn(9, 576), w.t().t()[:, ::2])):
        with pytest.raises(RuntimeError, match="float32, w contiguous"):
            _kernel(x, w2)


@pytest.mark.parametrize("n", [2 * small_rows_linear.CHUNK, 2 * small_rows_linear.CHUNK + 1, 49152, 20000, 151936, 128256])
def test_tall_weights_in_slabs_are_the_whole_products_bits(n):
    """The LM head's shape and ragged last slabs: each slab's sgemm sums exactly what the whole one sums."""
    gen = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, 576, generator=gen) * 0.05, torch.randn(32, 576, generator=gen)
    y = small_rows_linear.tall_mm(w, x.t())
    assert y.shape == (n, 32) and y.is_contiguous() and torch.equal(y, torch.mm(w, x.t()))


def test_swapped_only_where_it_applies_and_without_copies(monkeypatch):
    zen3, sapphire = frozenset({"avx2", "fma"}), frozenset({"avx2", "fma", "avx512f", "amx_bf16"})
    assert applies(CPU, torch.float32, zen3) and not applies(CPU, torch.bfloat16, zen3)
    assert not applies(CPU, torch.float32, sapphire) and not applies(torch.device("meta"), torch.float32, zen3)
    monkeypatch.setenv("PDSERVE_CPU_SMALL_ROWS_GEMM", "0")
    assert not applies(CPU, torch.float32, zen3)
    monkeypatch.delenv("PDSERVE_CPU_SMALL_ROWS_GEMM")
    monkeypatch.setattr(small_rows_linear, "applies", lambda device, dtype: dtype == torch.float32)
    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 8, bias=False)), nn.Embedding(4, 16))
    weight = model[0].weight
    assert swap_linears(model, CPU, torch.float32) == 2
    assert type(model[0]) is SmallRowsLinear and type(model[1][0]) is SmallRowsLinear
    assert model[0].weight is weight   # the same parameter, not a copy
    assert swap_linears(nn.Sequential(nn.Linear(4, 4)).bfloat16(), CPU, torch.bfloat16) == 0


@pytest.mark.skipif(not applies(CPU, torch.float32), reason="float32 linears take this path only on CPUs without "
                                                           "AVX-512 (this one has it, or it is switched off)")
def test_engine_runs_it_with_the_same_greedy_tokens(monkeypatch):
    from tests.support.switch_runs import switch_runs

    def probe(llm, served=[SmallRowsLinear.served]):   # calls served since the last probe
        model, before = llm.engine.model, served[0]
        served[0] = SmallRowsLinear.served
        return served[0] - before, type(model.layers[0].mlp.down_proj), model.head_gemm

    monkeypatch.setenv("PDSERVE_CPU_GGUF_CODES", "0")   # else its 1-4 row steps run on the GGUF codes (own test)
    runs = switch_runs(monkeypatch, "PDSERVE_CPU_SMALL_ROWS_GEMM", probe)
    (off, (off_served, off_type, off_head)), (on, (on_served, on_type, on_head)) = runs["0"], runs["1"]
    assert off_served == 0 and off_type is nn.Linear and off_head is F.linear
    assert on_served > 0 and on_type is SmallRowsLinear   # the 4-sequence decode steps ran on it
    assert on_head is small_rows_linear.linear            # and the tied LM head's products
    assert on == off
