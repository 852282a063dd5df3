"""Active health checks and load scraping: every ``health_interval`` each pod's ``/health`` and ``/metrics``
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, summed over label
sets). A pod that answers /health with an error or refuses the connection is unhealthy at once; one that is
merely slow (no answer within ``health_timeout``: a busy pod, or this router's own loop briefly busy) stays routable
until ``health_slow_limit`` checks in a row were slow. Requests to pods carry ``upstream_api_key`` when set.
Passive health is the per-pod circuit breaker, fed by the proxy. The same loop expires speculative
prefix-index entries and refreshes the endpoint gauges."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from pdserve.router.config import RouterConfig
from pdserve.router.drain_signal import fingerprint_from_health
from pdserve.router.endpoints import Endpoint, EndpointPool
from pdserve.router.metrics import RouterMetrics
from pdserve.router.plugins.lora_affinity import parse_lora_info
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

SCRAPED = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_usage"}


def parse_load(text: str) -> dict[str, float]:
    """Sum each scraped metric over its label sets (a pod may report per model). Unknown lines are ignored."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = SCRAPED.get(name)
        if attr is None:
            continue
        rest = line[line.index("}") + 1:] if "{" in line else line[len(name):]
        try:
            out[attr] = out.get(attr, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return out


class HealthMonitor:
    def __init__(self, cfg: RouterConfig, pool: EndpointPool, metrics: RouterMetrics, index: PrefixIndex):
        self.cfg, self.pool, self.metrics, self.index = cfg, pool, metrics, index
        self.session: aiohttp.ClientSession | None = None
        self.rounds = 0  # completed check rounds
        self.slow: dict[str, int] = {}  # url -> consecutive slow checks
        key = cfg.upstream_api_key
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as self.session:
            while True:
                await self.check_all()
                await asyncio.sleep(self.cfg.health_interval)

    async def check_all(self) -> None:
        eps = list(self.pool)
        await asyncio.gather(*(self.check(ep) for ep in eps))
        live = {ep.url for ep in eps}
        for url in [u for u in self.slow if u not in live]:
            del self.slow[url]
        self.index.purge_expired()
        self.metrics.index_blocks.set(len(self.index))
        counts: dict[tuple[str, str], int] = {}
        for ep in self.pool:
            state = "healthy" if ep.healthy else "unhealthy"
            state = state if ep.breaker.state == "closed" else f"breaker_{ep.breaker.state}"
            counts[(ep.role, state)] = counts.get((ep.role, state), 0) + 1
        self.metrics.endpoints.clear()
        for (role, state), n in counts.items():
            self.metrics.endpoints.labels(role, state).set(n)
        self.rounds += 1

    async def check(self, ep: Endpoint) -> None:
        slow = False
        try:
            async with self.session.get(ep.url + "/health") as r:
                healthy = r.status == 200
                if healthy:
                    ep.kv_fingerprint = fingerprint_from_health(await r.content.read(4096))
            if healthy:
                async with self.session.get(ep.url + "/metrics") as r:
                    if r.status == 200:
                        text = await r.text()
                        for attr, value in {**parse_load(text), **parse_lora_info(text)}.items():
                            setattr(ep, attr, value)
        except asyncio.TimeoutError:
            slow, healthy = True, ep.healthy
            n = self.slow[ep.url] = self.slow.get(ep.url, 0) + 1
            if n >= self.cfg.health_slow_limit:
                healthy = False
            log.debug("health check of %s timed out (%d in a row)", ep.url, n)
        except (aiohttp.ClientError, OSError, UnicodeDecodeError) as e:
            healthy = False
            log.debug("health check of %s failed: %s", ep.url, e)
        if not slow:
            self.slow.pop(ep.url, None)
        if healthy != ep.healthy:
            log.info("endpoint %s is now %s", ep.url, "healthy" if healthy else "unhealthy")
        ep.healthy = healthy
