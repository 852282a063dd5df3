"""The router's LoRA affinity: scraping ``vllm:lora_requests_info`` and scoring pods (hand-computed, no network; the
scrape of a real pod's /metrics is checked in test_lora_server.py)."""

from __future__ import annotations

from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.config import RouterConfig
from pdserve.router.endpoints import Endpoint, EndpointSpec
from pdserve.router.framework import RequestContext, create
from pdserve.router.policies import build_profile
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.plugins.lora_affinity import parse_lora_info

METRICS = """# HELP vllm:num_requests_waiting Requests waiting.
vllm:num_requests_waiting{model_name="smol"} 0.0
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e+09
"""


def _pod(url: str, running=(), waiting=(), max_loras=2) -> Endpoint:
    e = Endpoint(EndpointSpec(url), CircuitBreaker())
    e.lora_running, e.lora_waiting, e.max_loras, e.base_model = frozenset(running), frozenset(waiting), max_loras, "smol"
    return e


def _ctx(model) -> RequestContext:
    return RequestContext("/v1/completions", {"model": model, "prompt": "x"}, {}, "rid")


def test_parse_lora_info():
    info = parse_lora_info(METRICS)
    assert info == {"lora_running": {"a", "b"}, "lora_waiting": {"c"}, "max_loras": 2, "base_model": "smol"}
    assert parse_lora_info('vllm:num_requests_waiting{model_name="m"} 1') == {"base_model": "m"}


def test_scores_prefer_resident_then_free_slot():
    pods = [_pod("http://hot", running={"x"}), _pod("http://free", running={"y"}),
            _pod("http://full", running={"y", "z"}), _pod("http://waits", waiting={"x"}, running={"q"})]
    scorer = create("lora-affinity")
    assert scorer.score(_ctx("x"), pods) == [1.0, 0.8, 0.0, 1.0]
    assert scorer.score(_ctx("smol"), pods) == [0.0] * 4          # the base model: no say
    assert scorer.score(_ctx("x"), [_pod("http://n", max_loras=0)]) == [0.0]   # no pod serves adapters


def test_precise_prefix_policy_routes_an_adapter_to_its_pod():
    profile = build_profile(RouterConfig(policy="precise-prefix"), PrefixIndex())
    pods = [_pod("http://a", running={"other"}), _pod("http://b", running={"x"}), _pod("http://c", running={"o", "p"})]
    assert profile.schedule(_ctx("x"), pods).endpoint.url == "http://b"
    pods[1].lora_running = frozenset({"o", "p"})
    assert profile.schedule(_ctx("x"), pods).endpoint.url == "http://a"   # the only free slot
