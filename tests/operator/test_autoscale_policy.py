"""The pure autoscaling decision on recorded metric windows (hand-computed expectations, no cluster)."""

from __future__ import annotations

import pydantic
import pytest

from pdserve.operator.autoscale_policy import Histogram, PoolWindow, State, decide, recommend
from pdserve.operator.models import InferenceServiceSpec, RoleAutoscaling
from pdserve.runtime.metrics import ITL_BUCKETS, TTFT_BUCKETS


def hist(bounds: tuple[float, ...], samples: list[float]) -> Histogram:
    """The delta histogram of ``samples`` in Prometheus' cumulative form."""
    les = (*bounds, float("inf"))
    return Histogram(tuple((le, float(sum(s <= le for s in samples))) for le in les), float(len(samples)))


def window(replicas: int, ready: int | None = None, ttft: list[float] = (), itl: list[float] = (), **kw) -> PoolWindow:
    return PoolWindow(replicas=replicas, ready_replicas=replicas if ready is None else ready, pods_scraped=replicas,
                      ttft=hist(TTFT_BUCKETS, list(ttft)), itl=hist(ITL_BUCKETS, list(itl)),
                      requests=kw.pop("requests", float(len(ttft) or len(itl))), **kw)


PREFILL = RoleAutoscaling(min_replicas=1, max_replicas=8, ttft_p90_seconds=1.0, prompt_tokens_per_second=1000,
                          scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=60)
DECODE = RoleAutoscaling(min_replicas=1, max_replicas=8, itl_p90_seconds=0.05, kv_cache_usage=0.8,
                         scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=60)


def run(windows: list[tuple[float, dict[str, PoolWindow]]], targets: dict[str, RoleAutoscaling] | None = None):
    """Feed windows in order; replicas follow the decisions (what the operator writes). Returns every decision."""
    targets = targets or {"prefill": PREFILL, "decode": DECODE}
    state, out = State(), []
    for now, pools in windows:
        decisions, state = decide(now, {r: (targets[r], w) for r, w in pools.items()}, state)
        out.append({d.role: d for d in decisions})
    return out


def test_histogram_quantile_matches_prometheus_interpolation():
    h = hist((0.1, 0.5, 1.0), [0.05] * 5 + [0.3] * 4 + [0.7])  # 10 samples: p90 rank 9 is the last of (0.1, 0.5]
    assert h.quantile(0.9) == pytest.approx(0.5)
    assert h.quantile(0.5) == pytest.approx(0.1)
    assert hist((1.0,), [5.0]).quantile(0.9) == 1.0  # in +Inf: the highest finite bound
    assert Histogram().quantile(0.9) is None


def test_scale_up_under_load_prefill_only_when_ttft_suffers_and_decode_is_idle():
    # prefill TTFTs 2.5s: p90 interpolated in (1, 2.5] is 2.35s (target 1s); decode idle: prefill 2 -> ceil(4.7) = 5
    [d] = run([(0, {"prefill": window(2, ttft=[2.5] * 10, prompt_tokens_per_s=900),
                    "decode": window(2, requests=0)})])
    assert (d["prefill"].desired, d["prefill"].direction) == (5, "up")
    assert "ttft p90 2.350s" in d["prefill"].reason
    assert d["decode"].desired == 2 and d["decode"].direction == "none"  # idle, but down-window not elapsed yet


def test_decode_only_growth_when_itl_suffers_and_prefill_is_fast():
    [d] = run([(0, {"prefill": window(2, ttft=[0.5] * 10, prompt_tokens_per_s=1900),
                    "decode": window(2, itl=[0.2] * 100, kv_cache_usage=0.5)})])
    assert d["prefill"].desired == 2  # p90 0.5/1.0 and 1900/(2*1000) = 0.95: inside the tolerance band
    assert d["decode"].desired == 6 and "itl p90" in d["decode"].reason  # 2 * 0.2/0.05 = 8, step limit 4


def test_prefill_demand_is_uncached_prompt_tokens_not_request_count():
    # many short/cached requests (high request count) but few uncached tokens: no prefill growth
    cached = window(2, ttft=[0.02] * 500, prompt_tokens_per_s=300)
    assert recommend(PREFILL.model_copy(update={"ttft_p90_seconds": None}), cached)[0] == 1  # 300/2000 -> 1
    heavy = window(2, ttft=[0.02] * 10, prompt_tokens_per_s=6000)
    assert recommend(PREFILL, heavy) == (6, pytest.approx(recommend(PREFILL, heavy)[1]))
    assert "uncached prompt tokens 6000/s" in recommend(PREFILL, heavy)[1]


def test_no_flapping_at_the_boundary():
    # KV usage oscillating around its target (ratio 0.93 .. 1.07, ITL well under target) never changes the replicas
    seq = [(t * 15.0, {"decode": window(4, itl=[0.02] * 50, kv_cache_usage=0.8 * f)})
           for t, f in enumerate([0.93, 1.07, 0.95, 1.05, 0.97, 1.03] * 3)]
    assert all(d["decode"].direction == "none" for d in run(seq))
    # the same just outside the band does move (so the test above can fail)
    assert run([(0, {"decode": window(4, itl=[0.02] * 50, kv_cache_usage=0.8 * 1.12)})])[0]["decode"].desired == 5


def test_one_spike_or_one_dip_does_not_scale_with_up_window():
    slow_up = DECODE.model_copy(update={"scale_up_stabilization_seconds": 30})
    seq = [(0, {"decode": window(2, itl=[0.05] * 50)}), (15, {"decode": window(2, itl=[0.2] * 50)}),
           (30, {"decode": window(2, itl=[0.05] * 50)})]
    assert [d["decode"].desired for d in run(seq, {"decode": slow_up})] == [2, 2, 2]


def test_scale_down_only_after_the_window_and_by_steps():
    busy = {"prefill": window(4, ttft=[1.0] * 20, prompt_tokens_per_s=4000)}  # ratio 1: hold at 4
    quiet = {"prefill": window(4, requests=0)}
    decisions = run([(0, busy), (20, quiet), (40, quiet), (59, quiet), (61, quiet)])
    assert [d["prefill"].desired for d in decisions[:4]] == [4, 4, 4, 4]  # 0s recommendation (4) still in the window
    assert "stabilizing" in decisions[2]["prefill"].reason
    assert decisions[4]["prefill"].desired == 3 and decisions[4]["prefill"].direction == "down"  # step 1
    assert "idle" in decisions[4]["prefill"].reason


def test_min_and_max_are_respected():
    [d] = run([(0, {"prefill": window(7, ttft=[40.0] * 10), "decode": window(1, requests=0)})])
    assert d["prefill"].desired == 8  # 7 * 40 = 280, max 8
    later = run([(0, {"decode": window(1, requests=0)}), (100, {"decode": window(1, requests=0)})],
                {"decode": DECODE})
    assert [d["decode"].desired for d in later] == [1, 1]  # min 1
    [d] = run([(0, {"decode": window(12, itl=[0.05] * 10)})])
    assert d["decode"].desired == 8 and "outside [1, 8]" in d["decode"].reason  # hand-edited above max: back at once


def test_no_scale_up_while_earlier_pods_are_not_ready():
    [d] = run([(0, {"prefill": window(4, ready=2, ttft=[3.0] * 10)})])
    assert d["prefill"].desired == 4 and "2 replicas not ready" in d["prefill"].reason


def test_no_metrics_holds():
    w = PoolWindow(replicas=3, ready_replicas=3, pods_scraped=0)
    assert recommend(PREFILL, w) == (3, "no metrics from any pod")


@pytest.mark.parametrize("bad,message", [
    ({"minReplicas": 5, "maxReplicas": 2, "queueDepth": 1}, "minReplicas must be <= maxReplicas"),
    ({"maxReplicas": 2}, "at least one target"),
    ({"maxReplicas": 2, "ttftP90Seconds": 0}, "greater than 0"),
])
def test_spec_validation(bad, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        RoleAutoscaling.model_validate(bad)
    with pytest.raises(pydantic.ValidationError, match="autoscaling.prefill requires spec.prefill"):
        InferenceServiceSpec.model_validate({"model": {"name": "m"}, "autoscaling": {
            "prefill": {"maxReplicas": 2, "queueDepth": 1}}})
