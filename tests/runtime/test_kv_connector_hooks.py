"""The engine's KV connector hooks, driven by a small but real in-memory connector defined here.

``MemoryConnector`` implements the pdserve.kv_connectors.base contract: a producer engine stores its prompt blocks by
block hash into a shared in-process store (and holds them, delay_free, until a consumer has read them); a consumer
engine loads matching blocks into its own cache (synchronously, or asynchronously over a few polls) and computes only
the rest. A switch corrupts chosen blocks on load and reports them as failed, to exercise recovery: recompute from the
first bad block, or fail the request with finish_reason "error". All engines run the real default model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pdserve.kv_connectors.base import KVConnectorBase, KVConnectorMetadata, register_connector
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.engine import LLMEngine
from pdserve.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
BS = 16


@dataclass
class Store:
    blocks: dict[bytes, torch.Tensor] = field(default_factory=dict)   # block hash -> one block's KV, all layers
    sent: set[str] = field(default_factory=set)                        # producer request ids a consumer has read


@register_connector("test_memory")
class MemoryConnector(KVConnectorBase):
    """config: store (Store), async_polls (0 = synchronous loads), corrupt (block indexes to corrupt on load)."""

    def __init__(self, role: str, config: dict[str, Any], spec) -> None:
        super().__init__(role, config, spec)
        self.store: Store = config["store"]
        self.async_polls = config.get("async_polls", 0)
        self.corrupt = set(config.get("corrupt", ()))
        self.kv: torch.Tensor | None = None
        self._match: dict[str, tuple] = {}                              # rid -> (first block, n, producer id, hashes)
        self._loads: dict[str, list[tuple[int, int]]] = {}
        self._in_flight: dict[str, list] = {}                           # rid -> [polls left, loads, hashes, producer]
        self._to_save: dict[str, list[tuple[bytes, int]]] = {}
        self._holding: set[str] = set()
        self._errors: set[int] = set()
        self._recved: set[str] = set()
        self.num_loaded_blocks = 0

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        first = num_computed_tokens // BS
        last = first
        limit = (len(request.prompt_token_ids) - 1) // BS                # never the last prompt token
        while last < limit and request.block_hashes[last] in self.store.blocks:
            last += 1
        self._match[request.request_id] = (first, last - first, params.get("remote_request_id"),
                                           list(request.block_hashes))
        return (last - first) * BS, self.async_polls > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first, n = self._match.get(request.request_id, (0, 0))[:2]
        if num_external_tokens:
            self._loads[request.request_id] = [(i, block_ids[i]) for i in range(first, first + n)]

    def build_connector_meta(self):
        meta, self._loads = KVConnectorMetadata(loads=self._loads), {}
        return meta

    def request_scheduled_for_save(self, request, block_ids, num_computed_tokens):
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            n = min(num_computed_tokens, len(request.prompt_token_ids)) // BS
            self._to_save[request.request_id] = [(request.block_hashes[i], block_ids[i]) for i in range(n)]

    def request_finished(self, request, block_ids):
        if not (request.kv_transfer_params or {}).get("do_remote_decode") or request.status.finish_reason == "abort":
            return False, None
        self._flush_saves()
        self._holding.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": request.request_id,
                      "remote_block_ids": block_ids, "remote_engine_id": "memory"}

    # worker side
    def register_kv_caches(self, kv_cache):
        self.kv = kv_cache

    def start_load_kv(self, meta):
        for rid, loads in meta.loads.items():
            _, _, producer, hashes = self._match.pop(rid)
            self._in_flight[rid] = [self.async_polls, loads, hashes, producer]
            if self.async_polls == 0:
                self._complete(rid)

    def save_kv(self, meta):
        self._flush_saves()

    def get_finished(self):
        for rid in list(self._in_flight):
            self._in_flight[rid][0] -= 1
            if self._in_flight[rid][0] < 0:
                self._complete(rid)
                self._recved.add(rid)
        sent = self._holding & self.store.sent
        self._holding -= sent
        recved, self._recved = self._recved, set()
        return sent, recved

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors

    def _complete(self, rid: str) -> None:
        _, loads, hashes, producer = self._in_flight.pop(rid)
        for i, block_id in loads:
            data = self.store.blocks.get(hashes[i])
            if data is None or i in self.corrupt:
                self.kv[block_id].normal_()                             # garbage lands in the cache...
                self._errors.add(block_id)                              # ...and is reported
            else:
                self.kv[block_id].copy_(data)
                self.num_loaded_blocks += 1
        if producer is not None:
            self.store.sent.add(producer)

    def _flush_saves(self) -> None:
        for items in self._to_save.values():
            for h, block_id in items:
                self.store.blocks.setdefault(h, self.kv[block_id].clone())
        self._to_save = {}

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a screw press adapted from wine making. Within fifty years,")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def engine(store: Store | None = None, role: str = "both", policy: str = "recompute", **cfg) -> LLMEngine:
    opts: dict[str, Any] = dict(dtype="float32", max_model_len=512, num_gpu_blocks=48)
    if store is not None:
        opts.update(kv_connector="test_memory", kv_role=role, kv_load_failure_policy=policy,
                    kv_connector_config={"store": store, **cfg})
    return LLMEngine(EngineConfig.from_options(**opts))


def run(e: LLMEngine, rid: str, prompt, params=GREEDY, **kw):
    e.add_request(rid, prompt, params, **kw)
    while True:
        for out in e.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.fixture(scope="module")
def store():
    return Store()


@pytest.fixture(scope="module")
def producer(store):
    e = engine(store, role="prefill")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(producer):
    """Plain greedy continuation (no connector involved: no do_remote_* params)."""
    return run(producer, "ref", PROMPT).outputs[0].token_ids


@pytest.fixture(scope="module")
def handoff(producer, reference):
    """Prefill on the producer: max_tokens=1, blocks held for the consumer; returns its kv_transfer_params."""
    out = run(producer, "p1", PROMPT, SamplingParams(temperature=0.0, max_tokens=1),
              kv_transfer_params={"do_remote_decode": True}, cache_salt="pd")
    assert out.outputs[0].token_ids == reference[:1]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_request_id"] == "p1"
    assert producer.scheduler.kv.get_block_ids("p1") == params["remote_block_ids"]   # held (delay_free)
    assert producer.has_pending_kv_transfers() and producer.has_unfinished_requests()   # what drain waits for
    return params


@pytest.fixture(scope="module")
def consumer(store):
    e = engine(store, role="decode")
    yield e
    e.shutdown()


@pytest.fixture
def fresh(consumer):
    """Reconfigure the shared consumer for one test: no prefix cache left from earlier tests, counters as deltas."""
    def configure(async_polls=0, corrupt=(), policy="recompute"):
        assert consumer.reset_prefix_cache()
        consumer.connector.async_polls, consumer.connector.corrupt = async_polls, set(corrupt)
        consumer.scheduler.kv_transfers.load_failure_policy = policy
        return consumer.get_stats()
    return configure


def test_sync_load_then_producer_frees(consumer, fresh, producer, reference, handoff):
    before = fresh()
    n_prompt = len(consumer.tokenizer.encode(PROMPT, add_special_tokens=False))
    out = run(consumer, "d1", PROMPT, kv_transfer_params=handoff, cache_salt="pd")
    assert out.outputs[0].token_ids == reference
    loaded = (n_prompt - 1) // BS * BS
    assert out.num_cached_tokens == loaded and consumer.connector.num_loaded_blocks == loaded // BS
    assert consumer.get_stats().prompt_tokens - before.prompt_tokens == n_prompt - loaded   # only the rest computed
    assert producer.get_stats().kv_cache_usage > 0 and producer.has_unfinished_requests()
    producer.step()                                                               # polls get_finished(): sent
    assert producer.get_stats().kv_cache_usage == 0 and "p1" not in producer.scheduler.kv_transfers.sending
    assert not producer.has_pending_kv_transfers()


@pytest.mark.parametrize("async_polls", [0, 2])
def test_corrupt_load_recomputes_from_first_bad_block(consumer, fresh, reference, handoff, async_polls):
    before = fresh(async_polls=async_polls, corrupt=[1])
    n_prompt = len(consumer.tokenizer.encode(PROMPT, add_special_tokens=False))
    loaded = (n_prompt - 1) // BS * BS
    consumer.add_request("d", PROMPT, GREEDY, kv_transfer_params=handoff, cache_salt="pd")
    if async_polls:
        consumer.step()
        assert consumer.scheduler.requests["d"].status.name == "WAITING_FOR_REMOTE_KVS"
        run(consumer, "local", PROMPT, SamplingParams(temperature=0.0, max_tokens=1), cache_salt="pd")
        assert consumer.get_stats().prefix_cache_hits == before.prefix_cache_hits   # in-flight blocks never hit
    out = None
    while out is None or not out.finished:
        out = next((o for o in consumer.step() if o.request_id == "d"), out)
    stats = consumer.get_stats()
    assert out.outputs[0].token_ids == reference                        # garbage KV was never used for output
    assert stats.kv_load_failures - before.kv_load_failures == 1
    assert stats.recomputed_tokens - before.recomputed_tokens == loaded - BS == out.metrics.num_recomputed_tokens


def test_fail_policy_finishes_with_error_and_never_caches_bad_blocks(consumer, fresh, reference, handoff):
    before = fresh(async_polls=1, corrupt=[1], policy="fail")
    out = run(consumer, "d", PROMPT, kv_transfer_params=handoff, cache_salt="pd")
    assert out.finished and out.outputs[0].finish_reason == "error" and "KV load failed" in out.error
    assert consumer.get_stats().kv_load_failures - before.kv_load_failures == 1
    assert consumer.get_stats().kv_cache_usage == 0
    again = run(consumer, "again", PROMPT, cache_salt="pd")             # local compute, no bad block reused
    assert again.outputs[0].token_ids == reference and again.num_cached_tokens == 0
