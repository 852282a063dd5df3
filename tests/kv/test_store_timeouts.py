"""A hung store never holds the engine thread: the admission lookup and a handoff's synchronous write are waited for
with a deadline (real disk connector; the hang itself is injected into the DiskStore, the one test double here, since
a disk that stops answering cannot be made on demand)."""

from __future__ import annotations

import threading

import pytest

from pdserve.kv_connectors.base import create_connector
from pdserve.kv_connectors.disk_connector import DiskStore
from tests.kv.conftest import BLOCK, SPEC, Req, make_cache, prefill

PROMPT = list(range(300, 300 + 3 * BLOCK + 1))   # 3 full blocks + 1 token


@pytest.fixture
def hang():
    """An event the injected store call waits on (at most 60 s); set at teardown so no thread stays stuck."""
    ev = threading.Event()
    yield ev
    ev.set()


def test_hung_lookup_is_a_miss_not_a_stall(tmp_path, monkeypatch, hang):
    p = create_connector("disk", "prefill", {"path": str(tmp_path)}, SPEC)
    p.register_kv_caches(make_cache(fill=True))
    prefill(p, Req("a", PROMPT), [1, 2, 3, 4])
    p.flush()
    d = create_connector("disk", "decode", {"path": str(tmp_path), "lookup_timeout_s": 0.2}, SPEC)
    d.register_kv_caches(make_cache())
    real = DiskStore.contains_many
    assert real(d.store, [h for h in Req("b", PROMPT).block_hashes]) == [True] * 3   # the blocks are there

    def stuck(self, hashes):
        hang.wait(60)
        return real(self, hashes)

    monkeypatch.setattr(DiskStore, "contains_many", stuck)
    assert d.get_num_new_matched_tokens(Req("b", PROMPT), 0) == (0, False)
    assert not hang.is_set()                       # returned while the store call is still stuck
    assert d.metrics()["kv_store_errors"] == 1
    assert d.get_num_new_matched_tokens(Req("c", PROMPT), 0) == (0, False)   # store skipped while marked down
    assert d.metrics()["kv_store_errors"] == 1
    p.shutdown()
    d.shutdown()


def test_hung_handoff_write_returns_and_holds_blocks_until_written(tmp_path, monkeypatch, hang):
    p = create_connector("disk", "prefill", {"path": str(tmp_path), "handoff_timeout_s": 0.3}, SPEC)
    p.register_kv_caches(make_cache(fill=True))
    real = DiskStore.put_many
    entered = threading.Event()

    def stuck(self, items):
        entered.set()
        hang.wait(60)
        return real(self, items)

    monkeypatch.setattr(DiskStore, "put_many", stuck)
    req = Req("h", PROMPT, {"do_remote_decode": True})
    delay, params = p.request_finished(req, [5, 6, 7, 8])
    assert entered.is_set() and not hang.is_set()   # returned while the write is still stuck
    # The write still reads the live blocks (CPU cache, no snapshot): they stay allocated until it is done.
    assert delay and params["remote_block_ids"] == [5, 6, 7]
    assert p.get_finished() == (set(), set())
    hang.set()
    p.flush()
    for _ in range(500):
        sending, _ = p.get_finished()
        if sending:
            break
        threading.Event().wait(0.01)
    assert sending == {"h"}
    assert len(sorted((tmp_path / SPEC.fingerprint()).glob("*/*.kvb"))) == 3   # and the blocks did land
    p.shutdown()
