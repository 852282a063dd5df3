"""The autoscaling decision, pure: ``decide(now, pools, state) -> (decisions, state)``; no I/O, no clock.

Inputs are one metrics window per pool (``PoolWindow``: histogram and counter *deltas* over the last window, gauges as
the mean over the pool's pods, built by autoscale_metrics.py) and the pool's ``RoleAutoscaling`` targets. For each
pool:

1. every configured target gives a ratio observed/target (per replica): prefill demand is *uncached* prompt tokens per
   second (vLLM's ``prompt_tokens`` counts computed prompt tokens: prefix-cache hits and prompts the router keeps on
   decode never reach a prefill pod's counter), latency ratios are p90 of the window's histogram delta over the target
   and exist only when the window had requests; a window with no request at all in the pool is idle (ratio 0).
2. the raw recommendation is ``ceil(current * worst ratio)``; within ``1 +- tolerance`` it is ``current`` (the band
   that keeps a pool sitting at the boundary still), clamped to [min, max].
3. stabilization (as the HPA does): scale up to the *lowest* recommendation of the up-window, down to the *highest* of
   the down-window, so one spike does not add pods and one quiet window does not remove them; then step limits.
4. no scale-up while the pool still has replicas that are not ready (the pods added last time are not serving yet,
   so the window cannot show their effect); scale-down is still allowed.

Latency ratios drive scale-down too (proportionally, one step per decision by default); a pool never goes below
``minReplicas`` >= 1, since with no pod there would be no metrics to scale up from.

Each pool is decided on its own metrics, which is what makes it P:D-aware: TTFT over target with an idle decode pool
grows prefill only, and ITL/KV pressure with fast prefill grows decode only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.operator.models import RoleAutoscaling


@dataclass(frozen=True)
class Histogram:
    """A histogram delta over the window: cumulative counts per upper bound (``+Inf`` last), as Prometheus has it."""

    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), ascending le
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket; None when empty."""
        if self.count <= 0 or not self.buckets:
            return None
        rank, prev_le, prev_count = q * self.count, 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return prev_le  # above the highest finite bound: report that bound, as Prometheus does
                in_bucket = cum - prev_count
                return prev_le + (le - prev_le) * ((rank - prev_count) / in_bucket if in_bucket else 1.0)
            prev_le, prev_count = le, cum
        return prev_le


@dataclass(frozen=True)
class PoolWindow:
    """One pool over the last window (sums/means over its scraped pods)."""

    replicas: int  # spec replicas now
    ready_replicas: int  # pods ready now
    pods_scraped: int  # pods whose /metrics answered in this and an earlier scrape
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    prompt_tokens_per_s: float = 0.0  # uncached prompt tokens computed per second, whole pool
    requests: float = 0.0  # requests finished in the window, whole pool
    waiting: float = 0.0  # mean vllm:num_requests_waiting per pod (latest scrape)
    running: float = 0.0  # mean vllm:num_requests_running per pod (latest scrape)
    kv_cache_usage: float = 0.0  # mean vllm:kv_cache_usage_perc per pod (latest scrape)

    @property
    def idle(self) -> bool:
        return self.pods_scraped > 0 and self.requests == 0 and self.ttft.count == 0 and self.itl.count == 0 \
            and self.waiting == 0 and self.running == 0 and self.prompt_tokens_per_s == 0


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str  # human readable: which metric drove it, e.g. "ttft p90 2.10s > target 1.00s (ratio 2.10)"

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "none"


@dataclass(frozen=True)
class State:
    """Recommendations of the recent past per pool: ((time, replicas), ...), oldest first; and when each pool's
    observation began (a scale-down needs a whole down-window of recommendations, also after an operator restart)."""

    history: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    since: dict[str, float] = field(default_factory=dict)


def ratios(target: RoleAutoscaling, w: PoolWindow) -> list[tuple[float, str]]:
    """(observed/target, description) for every target that has a value in this window."""
    out: list[tuple[float, str]] = []
    n = max(w.replicas, 1)
    if w.idle:
        return [(0.0, "idle: no requests in the window")]
    for name, hist, goal in (("ttft", w.ttft, target.ttft_p90_seconds), ("itl", w.itl, target.itl_p90_seconds)):
        p90 = hist.quantile(0.9) if goal else None
        if goal and p90 is not None:
            out.append((p90 / goal, f"{name} p90 {p90:.3f}s vs target {goal:.3f}s"))
    if target.prompt_tokens_per_second:
        r = w.prompt_tokens_per_s / (n * target.prompt_tokens_per_second)
        out.append((r, f"uncached prompt tokens {w.prompt_tokens_per_s:.0f}/s vs target "
                       f"{target.prompt_tokens_per_second:.0f}/s per replica"))
    if target.queue_depth:
        out.append((w.waiting / target.queue_depth, f"queue {w.waiting:.1f}/pod vs target {target.queue_depth:.1f}"))
    if target.kv_cache_usage:
        out.append((w.kv_cache_usage / target.kv_cache_usage,
                    f"kv usage {w.kv_cache_usage:.2f} vs target {target.kv_cache_usage:.2f}"))
    return out


def recommend(target: RoleAutoscaling, w: PoolWindow) -> tuple[int, str]:
    """Step 2 of the module docstring: (replicas, reason) before stabilization and step limits."""
    current = w.replicas
    if w.pods_scraped == 0 and current > 0:
        return max(target.min_replicas, min(target.max_replicas, current)), "no metrics from any pod"
    found = ratios(target, w)
    if not found:
        return max(target.min_replicas, min(target.max_replicas, current)), "no samples for any target"
    worst, why = max(found, key=lambda r: r[0])
    if abs(worst - 1.0) <= target.tolerance:
        raw = current
    else:
        raw = math.ceil(max(current, 1) * worst - 1e-9) if worst > 0 else 0
    desired = max(target.min_replicas, min(target.max_replicas, raw))
    if desired != raw:
        why += f"; clamped to [{target.min_replicas}, {target.max_replicas}]"
    return desired, f"{why} (ratio {worst:.2f})"


def decide_pool(now: float, role: str, target: RoleAutoscaling, w: PoolWindow, history: tuple[tuple[float, int], ...],
                since: float) -> tuple[Decision, tuple[tuple[float, int], ...]]:
    raw, why = recommend(target, w)
    keep = max(target.scale_up_stabilization_seconds, target.scale_down_stabilization_seconds)
    history = tuple((t, r) for t, r in history if now - t <= keep) + ((now, raw),)
    current = w.replicas
    up_window = [r for t, r in history if now - t <= target.scale_up_stabilization_seconds]
    down_window = [r for t, r in history if now - t <= target.scale_down_stabilization_seconds]
    desired = current
    if min(up_window) > current:
        desired = min(min(up_window), current + target.scale_up_step)
        if w.ready_replicas < current:
            desired, why = current, f"{why}; holding: {current - w.ready_replicas} replicas not ready yet"
    elif max(down_window) < current and now - since < target.scale_down_stabilization_seconds:
        why += f"; stabilizing: observed for {now - since:.0f}s of the {target.scale_down_stabilization_seconds}s " \
               "scale-down window"
    elif max(down_window) < current:
        desired = max(max(down_window), current - target.scale_down_step)
    elif raw < current:
        why += f"; stabilizing: a higher recommendation within {target.scale_down_stabilization_seconds}s"
    elif raw > current:
        why += f"; stabilizing: a lower recommendation within {target.scale_up_stabilization_seconds}s"
    if current < target.min_replicas or current > target.max_replicas:  # out of bounds (e.g. hand-edited): fix now
        desired = max(target.min_replicas, min(target.max_replicas, current))
        why = f"replicas {current} outside [{target.min_replicas}, {target.max_replicas}]"
    return Decision(role, current, desired, why), history


def decide(now: float, pools: dict[str, tuple[RoleAutoscaling, PoolWindow]],
           state: State) -> tuple[list[Decision], State]:
    """One decision per autoscaled pool (role -> (targets, window)); ``now`` in seconds, any monotonic origin."""
    decisions, history, since = [], {}, {}
    for role, (target, window) in sorted(pools.items()):
        since[role] = state.since.get(role, now)
        d, history[role] = decide_pool(now, role, target, window, state.history.get(role, ()), since[role])
        decisions.append(d)
    return decisions, State(history, since)
