"""The router's LoRA affinity: scraping ``vllm:lora_requests_info`` and scoring pods (hand-computed, no network; the
scrape of a real pod's /metrics is checked in test_lora_server.py)."""

from __future__ import annotations

import pytest

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
pdserve:lora_adapter_info{lora_digest="d-a",lora_name="a"} 1.0
pdserve:lora_adapter_info{lora_digest="d-b",lora_name="b"} 1.0
"""


def _pod(url: str, running=(), waiting=(), max_loras=2) -> Endpoint:
    e = Endpoint(EndpointSpec(url), CircuitBreaker())
    e.lora_running, e.lora_waiting, e.max_loras, e.base_model = frozenset(running), frozenset(waiting), max_loras, "smol"
    return e


def _ctx(model) -> RequestContext:
    return RequestContext("/v1/completions", {"model": model, "prompt": "x"}, {}, "rid")


def test_parse_lora_info():
    info = parse_lora_info(METRICS)
    assert info == {"lora_running": {"a", "b"}, "lora_waiting": {"c"}, "max_loras": 2, "base_model": "smol",
                    "lora_digests": {"a": "d-a", "b": "d-b"}}
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


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.router.prompt import PromptTokenizer, default_tokenizer_path

    return PromptTokenizer(default_tokenizer_path())


def test_prefix_scores_key_adapter_blocks_with_the_adapter_digest(tokenizer):
    """The pods' KV events carry block hashes the engine computed (runtime/block_hash.py): for an adapter request
    keyed with the digest of the adapter's weights. The router must key the prompt alike: an adapter request never
    scores a pod for base-model blocks (nor a base request for adapter blocks), a pod with other weights under the
    same name or without the adapter scores 0, and speculative entries of an adapter request stay adapter-keyed."""
    from pdserve.router.endpoints import EndpointPool
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.proxy import Router
    from pdserve.router.upstream import Upstream
    from pdserve.runtime.block_hash import hash_token_blocks
    from pdserve.runtime.kv_events import BlockStored, KVEventBatch

    cfg = RouterConfig(policy="precise-prefix", block_size=16)
    prompt = "You are a helpful assistant. " * 12
    ids = tokenizer.token_ids("/v1/completions", {"prompt": prompt})
    assert len(ids) >= 64
    pool = EndpointPool()
    pool.update([EndpointSpec(f"http://{n}") for n in ("base", "lora", "other", "none")])
    pods = {p.url.removeprefix("http://"): p for p in pool}
    for name, p in pods.items():
        p.max_loras, p.base_model = 2, "smol"
        p.lora_digests = {"x": "d-other" if name == "other" else "d-x"} if name != "none" else {}
    index = PrefixIndex(ttl=60)

    def stored(pod: str, digest: str | None) -> None:   # what the engine of ``pod`` publishes after a prefill
        hashes = hash_token_blocks(ids, 16, lora_digest=digest)
        index.apply(f"http://{pod}", KVEventBatch([BlockStored(hashes, None, ids[:len(hashes) * 16], 16,
                                                               "x" if digest else None)]))

    stored("base", None)
    stored("lora", "d-x")
    stored("other", "d-other")   # the same name, other weights (reloaded): its own digest
    stored("none", None)
    metrics = RouterMetrics()
    router = Router(cfg, pool, index, metrics, Upstream(cfg, metrics), tokenizer)
    scorer = create("precise-prefix", index=index)
    order = [pods[n] for n in ("base", "lora", "other", "none")]
    adapter = router.context("/v1/completions", {"model": "x", "prompt": prompt}, {}, "r1")
    base = router.context("/v1/completions", {"model": "smol", "prompt": prompt}, {}, "r2")
    assert adapter.lora_name == "x" and base.lora_name is None
    assert scorer.score(adapter, order) == [0.0, 1.0, 1.0, 0.0]   # "other" holds x's blocks under ITS digest
    assert scorer.score(base, order) == [1.0, 0.0, 0.0, 1.0]
    pods["other"].lora_digests = {"x": "d-x"}                        # other weights than the blocks it holds
    assert scorer.score(router.context("/v1/completions", {"model": "x", "prompt": prompt}, {}, "r3"),
                        order) == [0.0, 1.0, 0.0, 0.0]
    # the whole precise-prefix profile sends each request where its own blocks are
    profile = build_profile(cfg, index)
    assert profile.schedule(router.context("/v1/completions", {"model": "x", "prompt": prompt}, {}, "r4"),
                            [pods["base"], pods["lora"]]).endpoint.url == "http://lora"
    assert profile.schedule(base, [pods["base"], pods["lora"]]).endpoint.url == "http://base"
    # routing an adapter request records adapter-keyed speculative blocks: a base request gains nothing from it
    fresh = PrefixIndex(ttl=60)
    fresh.add_speculative("http://lora", adapter.hashes_for(pods["lora"]))
    assert create("precise-prefix", index=fresh).score(base, [pods["lora"]]) == [0.0]
    assert create("precise-prefix", index=fresh).score(adapter, [pods["lora"]]) == [1.0]


def test_adapter_requests_only_go_to_pods_that_have_the_adapter():
    """A pod that serves LoRA but has not got the adapter (just started, the operator has not loaded it yet) would
    answer 404: every policy leaves it out while another pod has the adapter; with none, the pods decide (404)."""
    for policy in ("precise-prefix", "round-robin", "least-loaded", "session-affinity"):
        profile = build_profile(RouterConfig(policy=policy), PrefixIndex())
        fresh, ready = _pod("http://fresh"), _pod("http://ready")
        ready.lora_digests = {"x": "d-x"}
        fresh.in_flight = 0
        ready.in_flight = 50                       # busier: load alone would pick the fresh pod
        picks = {profile.schedule(_ctx("x"), [fresh, ready]).endpoint.url for _ in range(4)}
        assert picks == {"http://ready"}, policy
        assert {profile.schedule(_ctx("smol"), [fresh, ready]).endpoint.url for _ in range(4)} >= {"http://fresh"}
        ready.lora_digests = {}
        assert profile.schedule(_ctx("x"), [fresh, ready]) is not None   # nobody has it: not filtered to nothing
