"""The pods the router can send to, and the live state it keeps per pod.

``EndpointPool`` owns the set: discovery (static or Kubernetes) calls ``update(specs)`` with the full desired set and
the pool adds/removes ``Endpoint`` objects, telling listeners (health monitor, KV event subscribers, prefix index) so
per-pod state never outlives its pod. Plugins only read endpoints; the proxy updates in-flight counts and the breaker;
the health monitor updates ``healthy`` and the scraped load (``waiting``, ``running``, ``kv_usage``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.config import KVEventSource, Role

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointSpec:
    """What discovery knows about one pod."""

    url: str                                  # http://host:port, no trailing slash
    role: Role = "both"
    kv_events: KVEventSource | None = None


class Endpoint:
    __slots__ = ("url", "role", "kv_events", "healthy", "breaker", "in_flight", "waiting", "running", "kv_usage",
                 "kv_fingerprint", "lora_running", "lora_waiting", "max_loras", "base_model",
                 "lora_digests")

    def __init__(self, spec: EndpointSpec, breaker: CircuitBreaker):
        self.url = spec.url
        self.role: Role = spec.role
        self.kv_events = spec.kv_events
        self.healthy = True        # optimistic until the first active check says otherwise
        self.breaker = breaker
        self.in_flight = 0         # requests this router has outstanding on the pod
        self.waiting = 0.0         # vllm:num_requests_waiting (scraped)
        self.running = 0.0         # vllm:num_requests_running (scraped)
        self.kv_usage = 0.0        # vllm:kv_cache_usage_perc in [0, 1] (scraped)
        self.kv_fingerprint: str | None = None  # from /health; P/D pairs only equal ones (drain_signal.compatible)
        self.lora_running: frozenset[str] = frozenset()  # vllm:lora_requests_info (scraped; plugins/lora_affinity.py)
        self.lora_waiting: frozenset[str] = frozenset()
        self.max_loras = 0                                # 0: the pod serves no adapters
        self.base_model: str | None = None                # model_name label of the pod's load metrics
        self.lora_digests: dict[str, str] = {}            # adapter -> weight digest (pdserve:lora_adapter_info)

    @property
    def routable(self) -> bool:
        return self.healthy and self.breaker.can_route()

    @property
    def load(self) -> float:
        """Work queued or running for this pod: the router's own in-flight requests or the pod's queue, whichever is
        larger (other routers' requests show in the pod's queue, ours show immediately)."""
        return max(float(self.in_flight), self.waiting + self.running)

    def __repr__(self) -> str:
        return f"Endpoint({self.url}, {self.role}, healthy={self.healthy}, in_flight={self.in_flight})"


Listener = Callable[[str, Endpoint], None]  # ("added" | "removed", endpoint)


class EndpointPool:
    def __init__(self, make_breaker: Callable[[], CircuitBreaker] = CircuitBreaker):
        self._by_url: dict[str, Endpoint] = {}
        self._make_breaker = make_breaker
        self._listeners: list[Listener] = []
        self.decoders: list[Endpoint] = []   # role decode|both (cached views, rebuilt on change)
        self.prefillers: list[Endpoint] = []  # role prefill

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def __len__(self) -> int:
        return len(self._by_url)

    def __iter__(self):
        return iter(list(self._by_url.values()))

    def get(self, url: str) -> Endpoint | None:
        return self._by_url.get(url)

    def update(self, specs: Iterable[EndpointSpec]) -> None:
        """Make the pool equal ``specs`` (a pod whose role or event source changed is replaced)."""
        wanted = {s.url.rstrip("/"): s for s in specs}
        for url, ep in list(self._by_url.items()):
            spec = wanted.get(url)
            if spec is None or spec.role != ep.role or spec.kv_events != ep.kv_events:
                del self._by_url[url]
                self._notify("removed", ep)
        for url, spec in wanted.items():
            if url not in self._by_url:
                ep = Endpoint(EndpointSpec(url, spec.role, spec.kv_events), self._make_breaker())
                self._by_url[url] = ep
                self._notify("added", ep)
        self.decoders = [e for e in self._by_url.values() if e.role in ("decode", "both")]
        self.prefillers = [e for e in self._by_url.values() if e.role == "prefill"]

    def _notify(self, event: str, ep: Endpoint) -> None:
        log.info("endpoint %s: %s (%s)", event, ep.url, ep.role)
        for fn in self._listeners:
            fn(event, ep)
