"""The float32 paged prefill-attention CPU kernel (kernels/paged_prefill_f32_cpu.py, AVX2): against float64 on ragged
prompts and on chunks that continue a cached prefix, with NaN in every unused slot; rows of other sequences are never
written; a row's output does not depend on how its prompt was split or on the threads; peaked scores; bad tables and
rows are errors; q is read in place from the qkv rows; the float32 engine runs it for prompts and chunks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import paged_prefill_cpu, paged_prefill_f32_cpu
from tests.support.prefill_cases import assert_bad_tables_and_rows_rejected, case, errors_vs_sdpa, reference
from tests.support.switch_runs import switch_runs

BUILD = paged_prefill_f32_cpu.load_extension()
pytestmark = pytest.mark.skipif(BUILD is not None, reason=f"kernel not built here: {BUILD}")


def _case(heads, kv_heads, chunks, seed=0, head_dim=64):
    return case(heads, kv_heads, chunks, seed, head_dim, torch.float32)


def _run(q, kv, tables, info, scale=0.125):
    out = torch.full_like(q, 7.0)   # rows no chunk owns must keep this
    paged_prefill_cpu.paged_prefill(q, out, kv, tables, info, scale)
    return out


def _check(out, q, kv, tables, info, scale=0.125, tol=2e-5):
    owned = torch.zeros(q.shape[0], dtype=torch.bool)
    for r0, want in reference(q, kv, tables, info, scale).items():
        got = out[r0:r0 + want.shape[0]].double()
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max() / want.abs().max()) <= tol
        owned[r0:r0 + want.shape[0]] = True
    assert (out[~owned] == 7.0).all()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 3, 32)])
def test_kernel_matches_float64(heads, kv_heads, head_dim):
    # whole prompts of every size around the 16-position item and 16-key chunk, and chunks continuing a cached prefix
    chunks = [(1, 1), (2, 2), (5, 5), (16, 16), (17, 17), (33, 33), (130, 130), (37, 250), (1, 70), (64, 200)]
    q, kv, tables, info = _case(heads, kv_heads, chunks, head_dim=head_dim)
    _check(_run(q, kv, tables, info), q, kv, tables, info)


def test_a_rows_output_does_not_depend_on_how_the_prompt_is_split_or_the_threads():
    n = 300
    q, kv, tables, info = _case(9, 3, [(n, n)], seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _run(q, kv, tables, info)[:n]
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(_run(q, kv, tables, info)[:n], whole)
            for tail in (1, 13, 37, 129):
                alone = _run(q[n - tail:n], kv, tables, torch.tensor([[0, tail, n]]))
                assert torch.equal(alone, whole[n - tail:]), (threads, tail)
                both = _run(torch.cat([q[:50], q[n - tail:n]]), kv, torch.cat([tables, tables]),
                            torch.tensor([[0, 50, 50], [50, tail, n]]))
                assert torch.equal(both[50:], whole[n - tail:]) and torch.equal(both[:50], whole[:50])
    finally:
        torch.set_num_threads(before)


def test_as_close_to_float64_as_torch_sdpa():
    q, kv, tables, info = _case(9, 3, [(300, 300), (48, 400)], seed=1)
    for ours, theirs in errors_vs_sdpa(q, kv, tables, info, _run(q, kv, tables, info)):
        assert ours <= 4 * theirs + 1e-6, (ours, theirs)


def test_peaked_scores_over_a_long_context():
    """One key dominating by a logit gap far past float32's exp range, 1,000 keys: the online softmax's rescaling."""
    q, kv, tables, info = _case(9, 3, [(40, 1000)])
    kv[tables[0, 2], 0, 3] = q[20].view(3, 3, 64)[:, 0] * 400    # key 35 matches row 20's head-0 query hard
    out = _run(q, kv, tables, info)
    _check(out, q, kv, tables, info)


def test_bad_tables_and_rows_are_errors_not_reads_out_of_bounds():
    assert_bad_tables_and_rows_rejected(_run, *_case(9, 3, [(20, 20), (5, 40)]))


def test_q_is_read_in_place_from_the_fused_qkv_rows():
    q, kv, tables, info = _case(9, 3, [(20, 20), (5, 40)])
    qkv = torch.cat([q, torch.full((q.shape[0], 6, q.shape[2]), float("nan"))], dim=1)
    want = _run(q, kv, tables, info)
    out = torch.full_like(q, 7.0)
    torch.ops.pdserve_prefill_f32_cpu.prefill(qkv[:, :9], out, kv, tables, info, 0.125)
    assert torch.equal(out, want)
    heads_apart = q.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(RuntimeError, match="each row's H \\* D contiguous"):
        torch.ops.pdserve_prefill_f32_cpu.prefill(heads_apart, torch.empty(q.shape), kv, tables, info, 0.125)
    out = torch.full_like(q, 7.0)
    paged_prefill_cpu.paged_prefill(heads_apart, out, kv, tables, info, 0.125)
    assert torch.equal(out, want)


def test_the_float32_engine_runs_it(monkeypatch):
    calls = []
    real = paged_prefill_cpu.paged_prefill
    monkeypatch.setattr(paged_prefill_cpu, "paged_prefill", lambda *a: calls.append(a[0].dtype) or real(*a))

    def served(llm):
        n = len(calls)
        calls.clear()
        return n

    runs = switch_runs(monkeypatch, "PDSERVE_CPU_PREFILL_ATTENTION", served, values=("torch", "paged"))
    assert runs["torch"][1] == 0 and runs["paged"][1] >= 30     # every layer of the prompts' step
    assert runs["paged"][0] == runs["torch"][0]                   # the same greedy tokens as SDPA's
