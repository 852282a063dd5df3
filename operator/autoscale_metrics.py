"""Metric windows for the autoscaler: parse a runtime pod's ``/metrics`` into a ``PodSample``, keep each pod's recent
samples, and fold one pool's pods into a ``PoolWindow`` of *deltas over the window* (autoscale_policy.py decides).

Only the vLLM-named series pdserve's runtime exports are read (runtime/metrics.py): the TTFT and inter-token latency
histograms, ``vllm:prompt_tokens`` (prompt tokens *computed*, so prefix-cache hits are excluded),
``vllm:request_success`` and the gauges ``num_requests_waiting``, ``num_requests_running``, ``kv_cache_usage_perc``.
A counter that went down (the pod restarted) counts from zero. Scraping is plain HTTP with a timeout; a pod that
does not answer is left out of the window (``pods_scraped``), never guessed.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdserve.operator.autoscale_policy import Histogram, PoolWindow

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:request_success": "requests"}
GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
          "vllm:kv_cache_usage_perc": "kv_cache_usage"}
SCRAPE_TIMEOUT = 3.0
MAX_BODY = 4 << 20  # a runtime's exposition is a few KB; anything this big is not one


@dataclass(frozen=True)
class PodSample:
    t: float  # when scraped (monotonic seconds)
    ttft: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), summed over label sets
    itl: tuple[tuple[float, float], ...] = ()
    values: dict[str, float] = field(default_factory=dict)  # COUNTERS and GAUGES by short name


def parse(text: str, t: float) -> PodSample:
    """A PodSample from Prometheus exposition text (raises ValueError on malformed text)."""
    buckets: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    values = {short: 0.0 for short in (*COUNTERS.values(), *GAUGES.values())}
    gauge_n = {short: 0 for short in GAUGES.values()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            base = s.name.removesuffix("_bucket")
            if s.name.endswith("_bucket") and base in buckets:
                le = float(s.labels["le"])
                buckets[base][le] = buckets[base].get(le, 0.0) + s.value
            elif s.name.removesuffix("_total") in COUNTERS and not s.name.endswith("_created"):
                values[COUNTERS[s.name.removesuffix("_total")]] += s.value
            elif s.name in GAUGES:
                values[GAUGES[s.name]] += s.value
                gauge_n[GAUGES[s.name]] += 1
    for short, n in gauge_n.items():  # a pod serves one model; mean over label sets just in case
        values[short] /= max(n, 1)
    return PodSample(t, tuple(sorted(buckets[TTFT].items())), tuple(sorted(buckets[ITL].items())), values)


async def scrape(session: aiohttp.ClientSession, url: str, t: float,
                 timeout: float = SCRAPE_TIMEOUT) -> PodSample | None:
    """GET ``url`` and parse it; None on any network/HTTP/parse failure (the pod is left out of the window)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False) as r:
            if r.status != 200:
                return None
            body = await r.content.read(MAX_BODY + 1)
            if len(body) > MAX_BODY:
                return None
        return parse(body.decode("utf-8", "replace"), t)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeError):
        return None


def _delta(new: float, old: float) -> float:
    return new - old if new >= old else new  # reset: the pod restarted and counts from zero


def _hist_delta(new: tuple[tuple[float, float], ...], old: tuple[tuple[float, float], ...]) -> dict[float, float]:
    before = dict(old)
    restarted = any(c < before.get(le, 0.0) for le, c in new)
    return {le: c if restarted else c - before.get(le, 0.0) for le, c in new}


class Windows:
    """Recent samples of every pod (by pod uid), trimmed to the window; one instance per InferenceService."""

    def __init__(self) -> None:
        self.samples: dict[str, deque[PodSample]] = {}

    def record(self, pod: str, sample: PodSample, window_s: float) -> None:
        q = self.samples.setdefault(pod, deque())
        q.append(sample)
        while len(q) > 2 and sample.t - q[1].t >= window_s:  # keep one sample at or before the window's start
            q.popleft()

    def forget_except(self, pods: set[str]) -> None:
        for gone in set(self.samples) - pods:
            del self.samples[gone]

    def pool(self, pods: list[str], replicas: int, ready: int, now: float) -> PoolWindow:
        """The PoolWindow of ``pods`` (uids): deltas between each pod's oldest kept and latest sample. Pods with
        fewer than two samples, or whose latest sample is stale (not from this round), are left out."""
        ttft: dict[float, float] = {}
        itl: dict[float, float] = {}
        tokens_per_s = requests = 0.0
        gauges = {short: 0.0 for short in GAUGES.values()}
        n = 0
        for pod in pods:
            q = self.samples.get(pod)
            if not q or len(q) < 2 or q[-1].t != now:
                continue
            old, new = q[0], q[-1]
            span = new.t - old.t
            if span <= 0:
                continue
            n += 1
            for acc, a, b in ((ttft, new.ttft, old.ttft), (itl, new.itl, old.itl)):
                for le, c in _hist_delta(a, b).items():
                    acc[le] = acc.get(le, 0.0) + c
            tokens_per_s += _delta(new.values["prompt_tokens"], old.values["prompt_tokens"]) / span
            requests += _delta(new.values["requests"], old.values["requests"])
            for short in gauges:
                gauges[short] += new.values[short]

        def hist(acc: dict[float, float]) -> Histogram:
            buckets = tuple(sorted(acc.items()))
            count = next((c for le, c in buckets if math.isinf(le)), 0.0)
            return Histogram(buckets, count)

        mean = {k: v / n for k, v in gauges.items()} if n else gauges
        return PoolWindow(replicas=replicas, ready_replicas=ready, pods_scraped=n, ttft=hist(ttft), itl=hist(itl),
                          prompt_tokens_per_s=tokens_per_s, requests=requests, **mean)
