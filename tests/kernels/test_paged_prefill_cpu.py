"""The paged prefill-attention CPU kernel (kernels/paged_prefill_cpu.py, bf16 on AMX): against a float64 reference on
ragged prompts and on chunks that continue a cached prefix, with poisoned unused slots; rows of other sequences are
never written; bad tables and rows are errors; the AMX tile state it borrows is handed back (oneDNN's bf16 GEMMs
right after it stay exact); the engine runs it by default in bf16 (chunked prefill included) and its greedy choices
agree with torch's SDPA path on >= 99% of positions, teacher-forced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import paged_prefill_cpu, paged_prefill_f32_cpu
from tests.support.forced_sampler import MODULES, agreement, drain, forced_greedy_runs
from tests.support.prefill_cases import case as _case
from tests.support.prefill_cases import reference as _reference
from tests.support.prefill_cases import assert_bad_tables_and_rows_rejected, errors_vs_sdpa

CPU = torch.device("cpu")
BUILD = paged_prefill_cpu.load_extension()
needs_kernel = pytest.mark.skipif(BUILD is not None, reason=f"kernel not built here: {BUILD}")


def _run(q, kv, tables, info, scale=0.125):
    out = torch.full_like(q, 7.0)   # rows no chunk owns must keep this
    paged_prefill_cpu.paged_prefill(q, out, kv, tables, info, scale)
    return out


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_kernel_matches_float64(heads, kv_heads):
    # whole prompts of every size around the 16-row tile and 64-key chunk, and chunks continuing a cached prefix
    chunks = [(2, 2), (5, 5), (16, 16), (17, 17), (63, 63), (64, 64), (65, 65), (130, 130), (37, 250), (1, 70),
              (64, 200)]
    q, kv, tables, info = _case(heads, kv_heads, chunks)
    out = _run(q, kv, tables, info)
    ref = _reference(q, kv, tables, info, 0.125)
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for r0, want in ref.items():
        got = out[r0:r0 + want.shape[0]].double()
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-2   # the bf16 output's own rounding
        owned[r0:r0 + want.shape[0]] = True
    assert (out[~owned] == 7.0).all()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_does_not_depend_on_how_the_prompt_is_split(threads):
    """The last rows of a prompt computed in one call with the whole prompt, and as a chunk after the rest is cached
    (a P/D handoff's tail, chunked prefill, a prefix-cache hit) or in a step with another sequence: the same bits. The
    rows land in other 16-row tiles each way, so this holds only if a tile's softmax gives each row the values it
    would get alone."""
    heads, kv_heads, n = 9, 3, 300
    q, kv, tables, info = _case(heads, kv_heads, [(n, n)], seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = _run(q, kv, tables, info)[:n]
        for tail in (1, 13, 37, 64, 129):
            rows = q[n - tail:n]
            alone = torch.tensor([[0, tail, n]])
            assert torch.equal(_run(rows, kv, tables, alone), whole[n - tail:]), tail
            # beside another sequence's rows (the same cache, its first 50 tokens as a prompt of their own)
            both = torch.cat([q[:50], rows])
            pair = torch.tensor([[0, 50, 50], [50, tail, n]])
            got = _run(both, kv, torch.cat([tables, tables]), pair)
            assert torch.equal(got[50:], whole[n - tail:]) and torch.equal(got[:50], whole[:50]), tail
    finally:
        torch.set_num_threads(before)



@needs_kernel
def test_the_threads_split_of_the_work_changes_no_bit():
    """Each thread takes a contiguous run of the step's tiles and repacks the K/V its run reads into a buffer of its
    own, kept between calls: with 1 to 8 threads (runs that split a (sequence, KV head) pair between threads, and
    more threads than tiles), steps alternating long and short contexts (a buffer grown, then reused), every output is
    the 1-thread output's bits, and that one is checked against float64."""
    steps = [[(32, 1024)], [(2, 2)], [(300, 300), (24, 1000), (1, 70), (17, 17)], [(5, 5), (3, 200)], [(1, 1)]]
    cases = [_case(9, 3, chunks, seed=i) for i, chunks in enumerate(steps)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = [_run(*case) for case in cases]
        for (q, kv, tables, info), out in zip(cases, single):
            for r0, want in _reference(q, kv, tables, info, 0.125).items():
                got = out[r0:r0 + want.shape[0]].double()
                assert float((got - want).abs().max() / want.abs().max()) <= 1e-2
        for threads in (2, 3, 5, 8):
            torch.set_num_threads(threads)
            for case, want in zip(cases, single):
                assert torch.equal(_run(*case), want), (threads, case[3].tolist())
    finally:
        torch.set_num_threads(before)

@needs_kernel
def test_no_worse_than_torch_sdpa_in_bf16():
    """The same inputs through torch's bf16 SDPA: the kernel's error vs float64 is of the same size."""
    q, kv, tables, info = _case(9, 3, [(300, 300), (48, 400)], seed=1)
    for ours, theirs in errors_vs_sdpa(q, kv, tables, info, _run(q, kv, tables, info)):
        assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


@needs_kernel
def test_peaked_scores_over_a_long_context():
    """One key dominating by a logit gap far past float32's exp range, 1,000 keys: the online softmax's rescaling."""
    q, kv, tables, info = _case(9, 3, [(40, 1000)])
    kv[tables[0, 2], 0, 3] = q[20].view(3, 3, 64)[:, 0] * 40    # key 35 matches row 20's head-0 query hard
    out, ref = _run(q, kv, tables, info), _reference(q, kv, tables, info, 0.125)[0]
    assert torch.isfinite(out[:40]).all()
    assert float((out[:40].double() - ref).abs().max() / ref.abs().max()) <= 1e-2


@needs_kernel
def test_bad_tables_and_rows_are_errors_not_reads_out_of_bounds():
    assert_bad_tables_and_rows_rejected(_run, *_case(9, 3, [(20, 20), (5, 40)]))


@needs_kernel
def test_q_is_read_in_place_from_the_fused_qkv_rows():
    """The RoPE output's q is a view whose rows hold q then k (and v): the op reads it where it lies, with the bits
    of its contiguous copy; a q whose heads are not each D contiguous is an error for the op and copied by the
    wrapper."""
    q, kv, tables, info = _case(9, 3, [(20, 20), (5, 40)])
    qkv = torch.cat([q, torch.full((q.shape[0], 6, q.shape[2]), float("nan"), dtype=q.dtype)], dim=1)
    view = qkv[:, :9]
    assert not view.is_contiguous()
    want = _run(q, kv, tables, info)
    out = torch.full_like(q, 7.0)
    torch.ops.pdserve_prefill_cpu.prefill(view, out, kv, tables, info, 0.125)
    assert torch.equal(out, want)
    heads_apart = q.transpose(0, 1).contiguous().transpose(0, 1)   # same values, a head's D no longer beside the next
    with pytest.raises(RuntimeError, match="each row's H \\* D contiguous"):
        torch.ops.pdserve_prefill_cpu.prefill(heads_apart, torch.empty(q.shape, dtype=q.dtype), kv, tables, info, 0.125)
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    paged_prefill_cpu.paged_prefill(heads_apart, out, kv, tables, info, 0.125)
    assert torch.equal(out, want)

@needs_kernel
def test_onednn_bf16_gemms_right_after_it_stay_exact():
    """The kernel configures AMX tiles on torch's threads; oneDNN's bf16 GEMMs (AMX here) run on the same threads."""
    gen = torch.Generator().manual_seed(3)
    a, w = (torch.randn(64, 576, generator=gen).bfloat16(), torch.randn(1536, 576, generator=gen).bfloat16())
    want = F.linear(a.float(), w.float())
    q, kv, tables, info = _case(9, 3, [(100, 100)])
    for _ in range(3):
        _run(q, kv, tables, info)
        assert torch.allclose(F.linear(a, w).float(), want, rtol=1e-2, atol=0.5)


def test_switch_dtype_and_head_dim(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_ATTENTION", "torch")
    assert not paged_prefill_cpu.enabled(CPU, torch.bfloat16, 64)
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREFILL_ATTENTION"):
        paged_prefill_cpu.enabled(CPU, torch.bfloat16, 64)
    monkeypatch.delenv("PDSERVE_CPU_PREFILL_ATTENTION")
    assert paged_prefill_cpu.enabled(CPU, torch.bfloat16, 64) is (BUILD is None)
    # float32: its own kernel (kernels/paged_prefill_f32_cpu.py, tests/kernels/test_paged_prefill_f32_cpu.py)
    assert paged_prefill_cpu.enabled(CPU, torch.float32, 64) is (paged_prefill_f32_cpu.load_extension() is None)
    assert not paged_prefill_cpu.enabled(CPU, torch.float32, 48)
    assert not paged_prefill_cpu.enabled(CPU, torch.bfloat16, 128)
    monkeypatch.setattr(paged_prefill_cpu, "load_extension", lambda: "no compiler")
    assert not paged_prefill_cpu.enabled(CPU, torch.bfloat16, 64)


@pytest.fixture(scope="module")
def greedy_runs():
    """Greedy tokens of 6 prompts (44-300 tokens, prefilled in chunks of at most 64 tokens) from a bf16 engine with
    prefills on torch's SDPA, then the kernel's top-1 choices on the same contexts; the kernel's calls recorded."""
    calls = []
    real = paged_prefill_cpu.paged_prefill
    words = ("the river ran past old stone mills where children counted boats and the wind carried songs of "
             "harvest over fields of barley toward the distant sea").split()
    prompts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(n))
               for i, n in enumerate((40, 90, 150, 200, 250, 280))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged_prefill_cpu, "paged_prefill", lambda *a: calls.append(a[4].tolist()) or real(*a))
        return forced_greedy_runs([(path, {"PDSERVE_CPU_PREFILL_ATTENTION": path, **MODULES}, {}) for path in ("torch", "paged")],
                                  prompts, 16, probe=lambda: drain(calls),
                                  dtype="bfloat16", max_model_len=512, num_gpu_blocks=160, max_num_batched_tokens=64)


@needs_kernel
def test_engine_runs_the_kernel_and_agrees_with_sdpa(greedy_runs):
    sdpa_tokens, sdpa_calls = greedy_runs["torch"]
    tokens, calls = greedy_runs["paged"]
    assert not sdpa_calls and calls
    rows = [r for call in calls for r in call]
    assert any(n > q_len > 1 for _, q_len, n in rows)     # chunks that continue a cached prefix ran on it
    same, total = agreement(sdpa_tokens, tokens)
    assert total == 6 * 16 and same / total >= 0.99, f"{same}/{total} positions agree"
