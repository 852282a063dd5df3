"""Unit tests of the router's scheduling pieces, with hand-computed scores (no network)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.circuit_breaker import CircuitBreaker
from pdserve.router.config import KVEventSource, RouterConfig
from pdserve.router.discovery import PodWatcher, pod_to_spec, static_specs
from pdserve.router.endpoints import Endpoint, EndpointPool, EndpointSpec
from pdserve.router.framework import Profile, RequestContext, create
from pdserve.router.health import parse_load
from pdserve.router.pd import REMOTE_DECODE_PARAMS, decode_body, prefill_body
from pdserve.router.policies import build_profile
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.prompt import block_hashes
from pdserve.runtime.block_hash import hash_token_blocks
from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ep(url: str, role: str = "both", **state) -> Endpoint:
    e = Endpoint(EndpointSpec(url, role), CircuitBreaker())
    for k, v in state.items():
        setattr(e, k, v)
    return e


def ctx(**kw) -> RequestContext:
    return RequestContext("/v1/completions", {}, kw.pop("headers", {}), "rid", **kw)


def wire(*events) -> KVEventBatch:
    """A batch as the router receives it: encoded by the runtime's codec, decoded by the router."""
    return decode_batch(encode_batch(KVEventBatch(list(events))))


TOKENS = list(range(64))  # 4 blocks of 16
H = hash_token_blocks(TOKENS, 16)


# -- prefix index ---------------------------------------------------------------------------------------------------
def test_index_longest_consecutive_prefix_from_real_event_batches():
    idx = PrefixIndex()
    idx.apply("a", wire(BlockStored(H[:3], None, TOKENS[:48], 16)))
    idx.apply("b", wire(BlockStored([H[0]], None, TOKENS[:16], 16), BlockStored([H[2]], H[1], TOKENS[32:48], 16)))
    assert idx.match(H, ["a", "b", "c"]) == {"a": 3.0, "b": 1.0, "c": 0.0}  # b lacks block 1: its block 2 does not count
    idx.apply("a", wire(BlockRemoved([H[1]])))
    assert idx.match(H, ["a"]) == {"a": 1.0}
    idx.apply("b", wire(AllBlocksCleared()))
    assert idx.match(H, ["a", "b"]) == {"a": 1.0, "b": 0.0}
    assert len(idx) == 2  # H0 (a), H2 (a)


def test_index_weights_slower_tiers_lower():
    idx = PrefixIndex()
    idx.apply("a", wire(BlockStored(H[:2], None, TOKENS[:32], 16, medium="CPU")))
    assert idx.match(H, ["a"]) == {"a": pytest.approx(1.6)}


def test_index_speculative_entries_expire():
    clock = Clock()
    idx = PrefixIndex(ttl=2.0, clock=clock)
    idx.add_speculative("a", H[:2])
    assert idx.match(H, ["a", "b"]) == {"a": 2.0, "b": 0.0}
    clock.t += 2.5
    assert idx.match(H, ["a"]) == {"a": 0.0}
    idx.purge_expired()
    assert not idx._spec
    idx.add_speculative("a", H)
    idx.forget_pod("a")
    assert idx.match(H, ["a"]) == {"a": 0.0}


def test_route_history_outlives_evictions_and_speculation():
    clock = Clock()
    idx = PrefixIndex(ttl=2.0, clock=clock)
    idx.add_speculative("a", H[:3])
    idx.add_speculative("b", H[:1])                      # block 0 was last routed to b: a's run starts nowhere
    assert idx.match_history(H, ["a", "b"]) == {"a": 0, "b": 1}
    idx.add_speculative("a", H)
    clock.t += 100                                        # speculative entries long gone, history stays
    assert idx.match(H, ["a"]) == {"a": 0.0} and idx.match_history(H, ["a", "b"]) == {"a": 4, "b": 0}
    pods = [ep("a"), ep("b")]
    assert create("route-history", index=idx).score(ctx(block_hashes=H), pods) == [1.0, 0.0]
    assert create("route-history", index=idx).score(ctx(block_hashes=H[:2] + [b"x" * 32]), pods) == [2 / 3, 0.0]
    idx.forget_history("a")
    assert idx.match_history(H, ["a"]) == {"a": 0}
    small = PrefixIndex(history_size=3)
    small.add_speculative("a", H[:2])
    small.add_speculative("b", H[2:])                     # 4 > 3 entries: history reset before recording
    assert small.match_history(H[2:], ["b"]) == {"b": 2} and small.match_history(H, ["a"]) == {"a": 0}


def test_router_hashes_equal_the_runtime_hashes_with_salt():
    assert block_hashes(TOKENS, 16, None) == H
    salted = block_hashes(TOKENS, 16, "tenant-1")
    assert salted == hash_token_blocks(TOKENS, 16, "tenant-1") and salted[0] != H[0]


# -- scorers --------------------------------------------------------------------------------------------------------
def test_precise_prefix_scorer_fraction_of_blocks():
    idx = PrefixIndex()
    idx.store("http://a", H[:3])
    idx.store("http://b", H[:1])
    pods = [ep("http://a"), ep("http://b"), ep("http://c")]
    c = ctx(block_hashes=H)
    assert create("precise-prefix", index=idx).score(c, pods) == [0.75, 0.25, 0.0]
    assert c.matched_blocks == {"http://a": 3.0, "http://b": 1.0, "http://c": 0.0}
    assert create("precise-prefix", index=idx).score(ctx(), pods) == [0.0, 0.0, 0.0]  # shorter than a block


def test_queue_kv_inflight_scorers():
    pods = [ep("a", waiting=0, kv_usage=0.25, in_flight=2), ep("b", waiting=4, kv_usage=1.0, in_flight=4),
            ep("c", waiting=12, kv_usage=1.2, in_flight=12)]
    assert create("queue").score(ctx(), pods) == [1.0, 0.5, 0.25]          # 1 / (1 + w/4)
    assert create("kv-usage").score(ctx(), pods) == [0.75, 0.0, 0.0]
    assert create("in-flight").score(ctx(), pods) == pytest.approx([2 / 3, 0.5, 0.25])
    assert create("queue", scale=1.0).score(ctx(), [ep("x", waiting=1)]) == [0.5]


def test_session_affinity_is_sticky_and_survives_other_pods_leaving():
    pods = [ep(f"http://p{i}") for i in range(5)]
    s = create("session-affinity", header="x-session-id")
    scores = s.score(ctx(headers={"x-session-id": "user-42"}), pods)
    assert sorted(scores) == [0, 0, 0, 0, 1.0]
    chosen = pods[scores.index(1.0)]
    others = [p for p in pods if p is not chosen][:2]
    again = s.score(ctx(headers={"x-session-id": "user-42"}), [chosen] + others)
    assert again == [1.0, 0.0, 0.0]
    assert s.score(ctx(), pods) == [0.0] * 5
    many = {pods[s.score(ctx(headers={"x-session-id": f"u{i}"}), pods).index(1.0)].url for i in range(50)}
    assert len(many) >= 3  # sessions spread over pods


# -- filters and pickers --------------------------------------------------------------------------------------------
def test_health_filter_drops_unhealthy_and_open_breakers():
    a, b, c = ep("a"), ep("b", healthy=False), ep("c")
    for _ in range(5):
        c.breaker.record_failure()
    assert create("health").filter(ctx(), [a, b, c]) == [a]


def test_load_guard_imbalance_rule():
    g = create("load-guard", abs_threshold=16, rel_threshold=1.5)
    p = [ep("a", in_flight=0), ep("b", in_flight=10), ep("c", in_flight=20)]
    assert [e.url for e in g.filter(ctx(), p)] == ["a", "b"]            # 20-0 > 16 and 20 > 1.5*0
    p = [ep("a", in_flight=20), ep("b", in_flight=30), ep("c", in_flight=40)]
    assert [e.url for e in g.filter(ctx(), p)] == ["a", "b"]            # 40-20 > 16 and 40 > 30
    p = [ep("a", in_flight=40), ep("b", waiting=45, running=10)]        # load(b) = max(0, 55) = 55
    assert [e.url for e in g.filter(ctx(), p)] == ["a", "b"]            # 15 <= 16: balanced enough


def test_pickers():
    pods = [ep("a", in_flight=3), ep("b", in_flight=1), ep("c", in_flight=1, waiting=4)]
    assert create("max-score").pick(ctx(), pods, [0.1, 2.5, 2.4]).url == "b"
    rr = create("round-robin")
    assert [rr.pick(ctx(), pods, [0] * 3).url for _ in range(4)] == ["a", "b", "c", "a"]
    assert create("least-loaded").pick(ctx(), pods, [0] * 3).url == "b"
    ties = {create("max-score", seed=s).pick(ctx(), pods, [1.0, 1.0, 0.0]).url for s in range(20)}
    assert ties == {"a", "b"}


def test_precise_profile_weighted_sum_hand_computed():
    idx = PrefixIndex()
    idx.store("http://a", H[:3])
    a = ep("http://a", waiting=8, kv_usage=0.5, in_flight=1)
    b = ep("http://b", waiting=0, kv_usage=0.0, in_flight=0)
    prof = build_profile(RouterConfig(policy="precise-prefix"), idx)
    d = prof.schedule(ctx(block_hashes=H), [a, b])
    # a: 3*0.75 + 2*(1/3) (queue) + 2*0.5 (kv) + 1*0.8 (in-flight) = 4.717;  b: 0 + 2*1 + 2*1 + 1*1 = 5.0
    assert d.endpoint is b and d.score == pytest.approx(5.0)
    assert d.scores["queue"] == pytest.approx([1 / 3, 1.0]) and d.scores["in-flight"] == pytest.approx([0.8, 1.0])
    a.waiting = 4  # a: 2.25 + 2*0.5 + 1 + 0.8 = 5.05 > 5.0: a long cached prefix outweighs a little load
    assert prof.schedule(ctx(block_hashes=H), [a, b]).endpoint is a
    idx.store("http://a", H[3:])
    a.waiting, a.in_flight = 0, 0
    d = prof.schedule(ctx(block_hashes=H), [a, b])
    # a: 3*1 + 2 + 2*0.5 + 1 = 7.0 > b: 0 + 2 + 2 + 1 = 5.0
    assert d.endpoint is a and d.score == pytest.approx(7.0)
    assert d.scores["precise-prefix"] == [1.0, 0.0]


def test_profile_strict_and_soft_filters():
    a = ep("a", healthy=False)
    prof = Profile([create("health")], [], create("round-robin"))
    assert prof.schedule(ctx(), [a]) is None
    guard_only = Profile([create("load-guard", abs_threshold=0, rel_threshold=0)], [], create("least-loaded"))
    assert guard_only.schedule(ctx(), [ep("x", in_flight=5)]).endpoint.url == "x"
    with pytest.raises(ValueError, match="unknown router plugin"):
        create("nope")


# -- circuit breaker ------------------------------------------------------------------------------------------------
def test_circuit_breaker_open_half_open_close():
    clock = Clock()
    cb = CircuitBreaker(threshold=3, open_seconds=30, clock=clock)
    for _ in range(2):
        cb.record_failure()
    cb.record_success()
    for _ in range(2):
        cb.record_failure()
    assert cb.state == "closed" and cb.can_route()       # success reset the count: 2 < 3
    cb.record_failure()
    assert cb.state == "open" and not cb.can_route()
    clock.t += 30
    assert cb.state == "half_open" and cb.can_route()
    cb.on_dispatch()
    assert not cb.can_route()                             # one probe at a time
    cb.record_failure()
    assert cb.state == "open"                             # failed probe re-opens for a full cool-down
    clock.t += 30
    cb.on_dispatch()
    cb.record_success()
    assert cb.state == "closed" and cb.can_route()


# -- P/D bodies, load parsing ---------------------------------------------------------------------------------------
def test_prefill_and_decode_bodies():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "max_completion_tokens": 40, "temperature": 0, "n": 3, "best_of": 3}
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert p["n"] == 1 and "best_of" not in p      # one sample: the prompt's KV is handed off (and moved) once
    assert "stream_options" not in p and p["kv_transfer_params"] == REMOTE_DECODE_PARAMS
    assert body["stream"] is True and "kv_transfer_params" not in body  # original untouched
    params = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "remote_engine_id": "e", "remote_host": "h",
              "remote_port": 1, "tp_size": 1, "remote_request_id": "r"}
    d = decode_body(body, params)
    assert d["kv_transfer_params"] is params and d["stream"] is True and d["max_tokens"] == 50 and d["n"] == 3
    assert d["stream_options"] == {"include_usage": True}


def test_parse_load_sums_label_sets():
    text = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="a"} 3.0\n'
            'vllm:num_requests_waiting{model_name="b"} 2\nvllm:kv_cache_usage_perc{model_name="a"} 0.5 1700000000\n'
            'vllm:num_requests_running 4\nvllm:prompt_tokens_total{model_name="a"} 99\nbogus{} x\n')
    assert parse_load(text) == {"waiting": 5.0, "kv_usage": 0.5, "running": 4.0}


# -- endpoint pool and discovery ------------------------------------------------------------------------------------
def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, role: str | None = "decode", rv: str = "1",
        deleting: bool = False) -> dict:
    labels = {"app": "pdserve"} | ({"pdserve.dev/role": role} if role else {})
    meta = {"name": name, "namespace": "ns", "labels": labels, "resourceVersion": rv}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8001}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_pod_to_spec():
    cfg = RouterConfig(kv_events_port=5557, kv_events_replay_port=5558)
    s = pod_to_spec(pod("a", role="prefill"), cfg)
    assert s == EndpointSpec("http://10.0.0.1:8001", "prefill",
                             KVEventSource("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"))
    assert pod_to_spec(pod("a", role=None), cfg).role == "both"
    assert pod_to_spec(pod("a", ready=False), cfg) is None
    assert pod_to_spec(pod("a", ip=None), cfg) is None
    assert pod_to_spec(pod("a", deleting=True), cfg) is None
    assert pod_to_spec(pod("a", role="weird"), cfg) is None


def test_static_specs_and_pool_update_notifies():
    cfg = RouterConfig(prefill=("http://p:1/",), decode=("http://d:2",),
                       kv_event_sources={"http://d:2": KVEventSource("tcp://d:9")})
    specs = static_specs(cfg)
    assert [(s.url, s.role) for s in specs] == [("http://p:1", "prefill"), ("http://d:2", "decode")]
    assert specs[1].kv_events == KVEventSource("tcp://d:9")
    events = []
    pool = EndpointPool()
    pool.add_listener(lambda kind, e: events.append((kind, e.url)))
    pool.update(specs)
    assert [e.url for e in pool.prefillers] == ["http://p:1"] and [e.url for e in pool.decoders] == ["http://d:2"]
    d = pool.get("http://d:2")
    pool.update([specs[1]])
    assert pool.get("http://d:2") is d and events[-1] == ("removed", "http://p:1")  # unchanged pod keeps its state
    pool.update([EndpointSpec("http://d:2", "both")])
    assert pool.get("http://d:2") is not d and pool.decoders[0].role == "both"


class ScriptedSource:
    """A PodSource fed from scripted lists/watch streams (the Kubernetes API itself is tested separately)."""

    def __init__(self, lists, watches):
        self.lists, self.watches, self.list_calls = list(lists), list(watches), 0

    async def list(self):
        self.list_calls += 1
        return self.lists.pop(0)

    async def watch(self, rv):
        events = self.watches.pop(0) if self.watches else []
        for e in events:
            if e == "raise":
                raise ConnectionError("apiserver went away")
            yield e
        if not self.watches:
            await asyncio.sleep(3600)


async def test_pod_watcher_tracks_ready_pods_and_relists_after_errors():
    pool = EndpointPool()
    src = ScriptedSource(
        lists=[([pod("a", "10.0.0.1")], "5"), ([pod("a", "10.0.0.1"), pod("c", "10.0.0.3", role="prefill")], "9")],
        watches=[[("ADDED", pod("b", "10.0.0.2", ready=False, rv="6")),
                  ("MODIFIED", pod("b", "10.0.0.2", ready=True, rv="7")),
                  ("DELETED", pod("a", "10.0.0.1", rv="8")),
                  ("ERROR", {"message": "too old resource version", "code": 410})],
                 [("ADDED", pod("d", "10.0.0.4", role="decode", rv="10"))]])
    seen = []
    pool.add_listener(lambda kind, e: seen.append((kind, e.url)))
    w = PodWatcher(RouterConfig(), pool, src, backoff=0.01)
    task = asyncio.create_task(w.run())
    try:
        for _ in range(200):
            if {e.url for e in pool} == {"http://10.0.0.1:8001", "http://10.0.0.3:8001", "http://10.0.0.4:8001"}:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert ("added", "http://10.0.0.2:8001") in seen          # became ready
    assert ("removed", "http://10.0.0.1:8001") in seen        # deleted, then back after the re-list
    assert src.list_calls == 2
    assert {(e.url, e.role) for e in pool} == {("http://10.0.0.1:8001", "decode"), ("http://10.0.0.3:8001", "prefill"),
                                               ("http://10.0.0.4:8001", "decode")}
