"""Speculative decoding without a model: config parsing, n-gram lookup, the rejection-sampling rule on synthetic p/q
(a statistical test), and scheduler scenarios with hand-computed counters (drafts as extra query tokens, rollback of
rejected drafts, prefix-cache blocks hashed only over accepted tokens, max_tokens / stop token never overshot)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.rejection_sampler import rejection_sample
from pdserve.runtime.request import Request
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.input_batch import CachedRequestState
from pdserve.runtime.sched_output import ModelRunnerOutput
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.spec_config import SpeculativeConfig
from pdserve.runtime.spec_propose import NgramProposer, ngram_lookup

BS = 4


# ---- config --------------------------------------------------------------------------------------------------------
def test_config_parse_vllm_shape():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
                                '"prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 2, 4)
    d = EngineConfig.from_options(speculative_config={"method": "draft_model", "model": "m", "num_speculative_tokens": 2})
    assert d.speculative_config == SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=2)
    for bad, msg in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                     ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                     ('{"bogus": 1}', "bogus"), ("[1]", "JSON object"), ("{", "JSON"),
                     ('{"method": "ngram", "model": "x"}', "draft_model")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


def test_cli_flag():
    import argparse

    from pdserve.runtime.cli import add_parser, engine_options

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_options(args)["speculative_config"].num_speculative_tokens == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", '{"method": "nope"}'])


# ---- n-gram lookup -------------------------------------------------------------------------------------------------
def test_ngram_lookup_longest_then_most_recent():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert ngram_lookup(t, 1, 3, 3) == [7, 8, 5]         # "2 3" last seen at 5..6 (3-gram "5 2 3" has no match)
    assert ngram_lookup(t, 3, 3, 3) == []                 # only 3-grams: none
    assert ngram_lookup(np.array([4, 4, 4]), 1, 2, 5) == [4]   # continuation clipped at the end
    assert ngram_lookup(np.array([5]), 1, 2, 3) == []


def test_ngram_lookup_is_linear():
    # A 200k-token sequence with no match: one vectorized pass per n (a quadratic scan would take minutes).
    t = np.arange(200_000)
    assert ngram_lookup(t, 1, 4, 4) == []


# ---- rejection sampling, statistically -----------------------------------------------------------------------------
def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_preserves_target_distribution(deterministic):
    """Emitted token i (given drafts 0..i-1 were accepted) must be distributed as p_i, whatever q is. R = 200k rows,
    V = 6, k = 3. Stated tolerance: the total-variation distance to p_i stays under 3x half the summed standard errors
    of the frequencies (<= 0.03 with the >= 5k samples each position gets); the naive rule (always emit the draft) is
    > 0.15 away, so the test has power."""
    g = torch.Generator().manual_seed(0)
    R, k, V = 200_000, 3, 6
    p1 = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1)             # target per position
    q1 = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1)                 # draft per position
    p = p1.expand(R, k + 1, V)
    if deterministic:   # n-gram style: the same fixed draft token everywhere (a likely one), q = one-hot
        drafts = p1[:k].argmax(dim=-1).expand(R, k).clone()
        q = None
        q_eff = torch.nn.functional.one_hot(drafts[0], V).float()
    else:
        drafts = torch.multinomial(q1.repeat(R, 1), 1, generator=g).view(R, k)
        q = q1.expand(R, k, V)
        q_eff = q1
    uniform = torch.rand(R, k, generator=g)
    noise = torch.empty(R, V).exponential_(generator=g)
    n_acc, final = rejection_sample(p, drafts, q, uniform, noise)
    emitted = torch.full((R, k + 1), -1)
    for i in range(k + 1):
        emitted[:, i] = torch.where(n_acc > i, drafts[:, min(i, k - 1)], torch.where(n_acc == i, final, -1))
    for i in range(k + 1):
        col = emitted[:, i][emitted[:, i] >= 0].numpy()
        assert col.size > 2_000, (i, col.size)
        pi = p1[i].numpy()
        tol = 3 * 0.5 * float(np.sqrt(pi * (1 - pi) / col.size).sum())   # 3x the summed standard errors, <= 0.05
        assert _tv(np.bincount(col, minlength=V), pi) < tol, (i, tol)
    assert 0 < int((n_acc > 0).sum()) < R and int((n_acc < k).sum()) > 0    # both outcomes exercised
    assert 0.5 * float((q_eff[0] - p1[0]).abs().sum()) > 0.15                  # naive rule would fail


def test_rejection_sampling_edge_cases():
    V = 4
    p = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    noise = torch.ones(1, V)
    # p(draft) = 1: always accepted, then the bonus draws from p[1]
    n, _ = rejection_sample(p, torch.tensor([[1]]), None, torch.tensor([[0.999]]), noise)
    assert int(n) == 1
    # p(draft) = 0: always rejected, and the residual never re-emits the draft
    n, tok = rejection_sample(p, torch.tensor([[2]]), None, torch.tensor([[0.0]]), noise)
    assert int(n) == 0 and int(tok) == 1


# ---- scheduler scenarios -------------------------------------------------------------------------------------------
def make(num_blocks=32, budget=64, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(block_size=BS,
                     enable_prefix_caching=caching), num_blocks, max_model_len=128)


def add(s: Scheduler, prompt: list[int], max_tokens=16, **sp) -> Request:
    r = Request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **sp), block_size=BS)
    s.add_request(r)
    return r


def run(s: Scheduler, emitted: list[int], drafts: list[int] | None = None):
    """One step whose 'model' emits ``emitted`` (accepted drafts + one) for the request and proposes ``drafts``."""
    out = s.schedule()
    starts = out.num_computed_tokens()
    ids = [r for r, n in out.num_scheduled_tokens.items()
           if starts[r] + n - len(out.scheduled_spec_decode_tokens.get(r, ())) == s.requests[r].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(ids, [list(emitted) for _ in ids], [None for _ in ids],
                                                {r: list(drafts) for r in ids} if drafts else {}))
    return out


def tokens_of(out, rid: str, r: Request) -> list[int]:
    """The query tokens the runner builds for ``rid``: its scheduled real tokens, then its drafts."""
    start, n = out.num_computed_tokens()[rid], out.num_scheduled_tokens[rid]
    drafts = out.scheduled_spec_decode_tokens.get(rid, [])
    return r.all_token_ids[start:start + n - len(drafts)] + drafts


def test_drafts_are_extra_query_tokens_and_rejections_roll_back():
    s = make()
    r = add(s, [1, 2, 3, 4, 5, 6])
    run(s, [7], drafts=[8, 9, 10])                         # prefill; the runner proposes 3 drafts
    assert r.spec_token_ids == [8, 9, 10]
    out = run(s, [8, 11])                                  # draft 8 accepted, 9 rejected -> target's 11
    assert tokens_of(out, "r", r)[:1] == [7] and out.num_scheduled_tokens == {"r": 4}
    assert out.scheduled_spec_decode_tokens == {"r": [8, 9, 10]} and out.num_computed_tokens()["r"] == 6
    assert r.output_token_ids == [7, 8, 11]
    assert r.num_computed_tokens == 8                      # 7 and 8 computed; 9, 10 rolled back; 11 not yet computed
    assert r.spec_token_ids == []                          # nothing proposed this time
    assert s.spec_stats.num_drafts == 1 and s.spec_stats.num_draft_tokens == 3
    assert s.spec_stats.num_accepted_tokens == 1 and s.spec_stats.num_accepted_tokens_per_pos == [1, 0, 0]
    # Blocks hashed only over computed (= accepted) tokens: 2 full blocks of [1..8], the 3rd (9 ...) not cached.
    assert s.kv.num_cached_blocks["r"] == 2
    r.spec_token_ids = [12]
    out = run(s, [12, 13])                                 # all accepted + bonus
    assert tokens_of(out, "r", r)[:1] == [11] and out.scheduled_spec_decode_tokens == {"r": [12]}
    assert out.num_computed_tokens()["r"] == 8
    assert r.num_computed_tokens == 10 and r.output_token_ids == [7, 8, 11, 12, 13]
    assert s.spec_stats.num_accepted_tokens_per_pos == [2, 0, 0]


def test_drafts_never_overshoot_max_tokens_or_stop():
    s = make()
    r = add(s, [1, 2, 3], max_tokens=4, stop_token_ids=[50])
    run(s, [7], drafts=[8, 9, 10, 11, 12])
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["r"] == [8, 9]      # 1 output + at most 2 drafts + 1 bonus = 4
    s.update_from_output(out, ModelRunnerOutput(["r"], [[8, 9, 5]], [None], {"r": [1, 2]}))
    assert r.output_token_ids == [7, 8, 9, 5] and r.is_finished and r.status.finish_reason == "length"
    assert r.spec_token_ids == []                                # a finished request keeps no drafts
    s2 = make()
    r2 = add(s2, [1, 2, 3], stop_token_ids=[50])
    run(s2, [7], drafts=[50, 9])
    run(s2, [50, 9, 4])                                          # the stop token ends the run: 9 and 4 dropped
    assert r2.output_token_ids == [7, 50] and r2.stop_reason == 50


def _state(rid: str, tokens: list[int], **sp) -> CachedRequestState:
    return CachedRequestState(rid, tokens, 2, SamplingParams(max_tokens=8, **sp), block_ids=[0, 1],
                              num_computed_tokens=len(tokens) - 1)


def test_no_drafts_outside_decode_or_with_penalties():
    s = make(budget=4)
    r = add(s, list(range(1, 10)))
    r.spec_token_ids = [1, 2]
    out = s.schedule()                                           # still prefilling: drafts ignored
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"r": 4}
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3), max_len=128)
    got = prop.propose([_state("p", [1, 2, 1, 2], repetition_penalty=1.2), _state("q", [1, 2, 1, 2]),
                        _state("m", [1, 2, 1, 2], min_tokens=5)], batch_size=3)
    assert got == {"q": [1, 2]}
    off = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=3), max_len=128)
    assert off.propose([_state("q", [1, 2, 1, 2])], batch_size=3) == {}
    assert off.propose([_state("q", [1, 2, 1, 2])], batch_size=2) == {"q": [1, 2]}


def test_budget_caps_drafts():
    s = make(budget=3)
    r = add(s, [1, 2])
    run(s, [7], drafts=[8, 9, 10])
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["r"] == [8, 9] and out.total_num_scheduled_tokens == 3
    assert math.isclose(s.kv.usage(), 2 / 32)
