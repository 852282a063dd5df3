"""The greedy LM head (kernels/greedy_head_cpu.py): its token is the full AMX head's ``argmax`` on every row, over
odd shapes (a last block of 16 columns with padding, K not a multiple of 64), 1 to 32 rows, both thread counts, exact
ties (the first index wins), near ties made by one-ulp weight changes, hidden rows of every scale, zero and non-finite
rows; it computes few column blocks exactly (the screen does its work); the bf16 engine takes plain greedy rows'
tokens from it, and only those (logprobs, penalties, min_tokens, sampling and steps of more than ``MAX_ROWS`` rows
keep the full head), with the same tokens as without it."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import amx_linear, greedy_head_cpu

BUILD = greedy_head_cpu.load_extension()
needs_screen = pytest.mark.skipif(BUILD is not None, reason=f"kernel not usable here: {BUILD}")


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _heads(w: torch.Tensor) -> tuple[amx_linear.AmxLinear, greedy_head_cpu.GreedyHead]:
    head = amx_linear.AmxLinear(w, None, lossless=False)   # an LM head: plain tiles (packed_linear.pack_linears)
    return head, greedy_head_cpu.GreedyHead(head)


def _full(head: amx_linear.AmxLinear, x: torch.Tensor) -> torch.Tensor:
    return head(x).float().argmax(dim=-1)


@needs_screen
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(4099, 576), (300, 80), (16, 64)])
def test_the_screened_token_is_the_full_heads(n, k, threads):
    head, gh = _heads(_bf16(n, k, seed=1, scale=0.05))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 3, 16, 17, 32):
            for scale in (1e-3, 1.0, 40.0):
                x = _bf16(m, k, seed=m, scale=scale)
                assert torch.equal(gh(x), _full(head, x)), (m, scale)
    finally:
        torch.set_num_threads(before)


@needs_screen
def test_the_int8_copy_is_each_row_rounded_on_its_own_grid():
    """The copy made at load: per row s = float(max |w| / 127) (1 for a zero row), q = w / s rounded half to even and
    clamped to 127, zero-padded, and the norms the bound uses, as float64 torch computes them."""
    n, k = 300, 80
    w = _bf16(n, k, seed=8, scale=0.05)
    w[3] = 0
    w[5, :6] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 127.0])   # s = 1: the halves round to even
    q, s, err, sqn = torch.ops.pdserve_greedy_head_cpu.quantize(w, 304, 128)
    wd = w.double()
    s_want = (wd.abs().amax(1) / 127).float().double()
    s_want = torch.where(s_want > 0, s_want, torch.ones_like(s_want))
    q_want = torch.round(wd / s_want[:, None]).clamp(-127, 127)
    assert torch.equal(s, s_want) and torch.equal(q[:n, :k], q_want.to(torch.int8))
    assert q[5, :6].tolist() == [0, 0, 2, 2, -2, 127] and not q[n:].any() and not q[:, k:].any()
    sq = q_want * s_want[:, None]
    assert torch.allclose(sqn, sq.norm(dim=1), rtol=1e-12, atol=0)
    assert torch.allclose(err, (wd - sq).norm(dim=1) + 3 * k * 2.0 ** -24 * wd.norm(dim=1), rtol=1e-12, atol=0)


@needs_screen
def test_ties_and_near_ties_keep_the_full_heads_first_index():
    """Rows equal to one row (exact ties, far apart in the vocab) and rows one bf16 ulp from it in a few weights
    (logits that differ in float32 and may round to the same bf16): the screen keeps them all and picks as argmax."""
    n, k = 2048, 576
    w = _bf16(n, k, seed=4, scale=0.05)
    base = w[37].clone()
    for row in (900, 1500, 2047):
        w[row] = base
    g = torch.Generator().manual_seed(5)
    for row in range(1000, 1040):   # one ulp up or down in 3 weights
        r = base.clone()
        idx = torch.randint(0, k, (3,), generator=g)
        bits = r.view(torch.int16)
        bits[idx] += torch.randint(0, 2, (3,), generator=g, dtype=torch.int16) * 2 - 1
        w[row] = r
    head, gh = _heads(w)
    x = (base.float() * 30 + _bf16(k, seed=6, scale=0.01).float()).bfloat16()[None].repeat(4, 1)
    x[1] = base.float().mul(3).bfloat16()
    x[2] = -x[0]
    got = gh(x)
    assert torch.equal(got, _full(head, x))
    assert gh.blocks >= 3    # the tied rows' blocks were all computed exactly


@needs_screen
def test_logits_apart_in_float32_but_equal_in_bf16_keep_the_first_index():
    """Row 3 scores 192 and row 100 192.25: apart by far more than their bounds (every row's largest weight is
    127/64, so the int8 copy is exact and the bounds tiny), yet both round to bf16 192, so the full head picks row 3;
    a screen that compared unrounded bounds would drop row 3's block and pick row 100."""
    n, k = 200, 64
    g = torch.Generator().manual_seed(12)
    w = torch.randint(-60, 61, (n, k), generator=g).float() / 64     # multiples of 1/64: bf16 and int8 exact
    w[:, 63] = 127 / 64
    w[3, :2] = torch.tensor([1.5, 0.0])
    w[100, :2] = torch.tensor([1.5, 1 / 64])
    x = torch.zeros(1, k)
    x[0, :2] = torch.tensor([128.0, 16.0])                            # others score <= 128 * 60/64 + 16 * 60/64
    w = w.bfloat16()
    head, gh = _heads(w)
    logits = x.double() @ w.double().T
    assert logits[0, 3] == 192 and logits[0, 100] == 192.25
    assert _full(head, x.bfloat16()).tolist() == [3] and gh(x.bfloat16()).tolist() == [3]


@needs_screen
def test_zero_and_non_finite_rows():
    head, gh = _heads(_bf16(500, 96, seed=7, scale=0.05))
    x = _bf16(4, 96, seed=8)
    x[0] = 0                   # every logit 0: all tie, token 0
    x[2, 5] = float("inf")     # nothing can be screened out: the full head's answer, whatever it is
    x[3, 7] = float("nan")
    got, want = gh(x), _full(head, x)
    assert got[0] == 0 and torch.equal(got, want)


@needs_screen
def test_the_screen_computes_few_blocks_exactly():
    """The feature's point: on a head of 3,072 blocks, a row's winner is found computing a small fraction of them."""
    head, gh = _heads(_bf16(49152, 576, seed=9, scale=0.05))
    x = _bf16(8, 576, seed=10)
    assert torch.equal(gh(x), _full(head, x))
    assert gh.screened == 8 and gh.blocks < 3072 // 10, gh.blocks


@needs_screen
def test_bad_shapes_are_errors():
    head, gh = _heads(_bf16(100, 64, seed=11))
    with pytest.raises(RuntimeError, match="M <= 32"):
        torch.ops.pdserve_greedy_head_cpu.screen(_bf16(33, 64), gh.q, gh.scale, gh.err, gh.sqn, 100)
    with pytest.raises(RuntimeError, match="packed shape"):
        torch.ops.pdserve_greedy_head_cpu.screen(_bf16(1, 128), gh.q, gh.scale, gh.err, gh.sqn, 100)
    with pytest.raises(RuntimeError, match="packed shape"):
        torch.ops.pdserve_greedy_head_cpu.screen(_bf16(1, 64), gh.q, gh.scale, gh.err, gh.sqn, 200)


@needs_screen
def test_the_engine_takes_plain_greedy_tokens_from_it_and_only_those():
    from pdserve.runtime import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", max_model_len=512, enable_prefix_caching=False)   # same prompts twice: both computed
    try:
        runner = llm.engine.runner
        gh = runner.greedy_head
        assert gh is not None and runner.model.lm_head is gh.head
        prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time"]
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        screened = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert gh.screened >= 4 * 24 and gh.blocks < gh.screened * 3072 // 10
        for params, plain in ((SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), 0),
                              (SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3), 0),
                              (SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2), 2),   # once 2 are out
                              (SamplingParams(temperature=0.8, max_tokens=4, seed=1), 0)):
            rows = gh.screened
            out = llm.generate(prompts[:1], params)[0].outputs[0]
            assert gh.screened == rows + plain and len(out.token_ids) == 4
            assert (out.logprobs is not None) == (params.logprobs is not None)
        rows = gh.screened           # one step sampling more rows than the screen pays for: every logit
        llm.generate([f"{i} apples and" for i in range(greedy_head_cpu.MAX_ROWS + 1)],
                     SamplingParams(temperature=0.0, max_tokens=1))
        assert gh.screened == rows
        runner.greedy_head = None    # every logit, as before the screen
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert screened == full
    finally:
        llm.shutdown()
