"""Redis connector against a real redis-server on a free loopback port."""

import time

import pytest
import redis
import torch

from pdserve.kv_connectors.base import create_connector
from tests.kv.conftest import BLOCK, SPEC, Req, load, make_cache, prefill, resign
from tests.support.redis import redis_server

PROMPT = list(range(50, 50 + 6 * BLOCK + 1))   # 6 full blocks + 1 token
IDS = [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def server():
    with redis_server(password="kv-secret", username="pdserve") as r:
        yield r


def _pair(url, **extra):
    cfg = {"url": url, "socket_timeout_s": 1.0, "connect_timeout_s": 0.5, **extra}
    p, d = create_connector("redis", "prefill", cfg, SPEC), create_connector("redis", "decode", cfg, SPEC)
    p.register_kv_caches(make_cache(fill=True))
    d.register_kv_caches(make_cache())
    return p, d


def test_handoff_round_trip_with_auth_and_ttl(server):
    p, d = _pair(server.url, ttl_s=120)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
    client = redis.Redis.from_url(server.url)
    keys = [p.store.key(bytes.fromhex(h)) for h in params["block_hashes"]]
    assert all(0 < client.ttl(k) <= 120 for k in keys)
    res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16])
    assert res.num_tokens == 6 * BLOCK and not res.bad_blocks
    assert all(torch.equal(p.kv_cache[s], d.kv_cache[t]) for s, t in zip(IDS[:6], range(10, 16)))
    assert d.metrics()["kv_blocks_loaded"] == 6


def test_wrong_password_is_a_clean_miss_and_error(server):
    bad_url = server.url.replace("kv-secret", "wrong")
    p, d = _pair(server.url)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
    _, d_bad = _pair(bad_url)
    res = load(d_bad, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16])
    assert res.bad_blocks == set(range(10, 16))
    assert load(d_bad, Req("x", PROMPT), [10, 11, 12, 13, 14, 15, 16]).num_tokens == 0   # lookups: a miss


def test_shared_prefix_and_pipelined_commands(server):
    p, d = _pair(server.url, async_load=False)
    client = redis.Redis.from_url(server.url)
    before = client.info("stats")["total_commands_processed"]
    prefill(p, Req("a", PROMPT), IDS)
    p.flush()
    res = load(d, Req("b", PROMPT[: 4 * BLOCK] + [1] * 9), [20, 21, 22, 23, 24])
    assert (res.num_tokens, res.bad_blocks) == (4 * BLOCK, set())
    assert torch.equal(d.kv_cache[23], p.kv_cache[4])
    # 6 SETs + 5 EXISTS + 4 GETEX (+ INFO and a few handshakes): pipelining sends them in a handful of round trips
    assert client.info("stats")["total_commands_processed"] - before < 30


def test_expired_blocks_are_load_errors(server):
    p, d = _pair(server.url, ttl_s=1)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
    time.sleep(2.2)
    res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16])
    assert res.bad_blocks == set(range(10, 16)) and d.metrics()["kv_load_failures{kind=missing}"] == 1


def test_corrupt_value_is_detected(server):
    p, d = _pair(server.url)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
    client = redis.Redis.from_url(server.url)
    key = p.store.key(bytes.fromhex(params["block_hashes"][1]))
    client.setrange(key, 500, b"\xff\xfe")
    res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16])
    assert res.bad_blocks == {11} and d.metrics()["kv_load_failures{kind=corrupt}"] == 1
    assert not client.exists(key) and d.metrics()["kv_corrupt_blocks_deleted"] == 1


def test_redis_killed_mid_run_loads_fail_fast_and_saves_are_skipped():
    with redis_server() as r:
        p, d = _pair(r.url, retry_after_s=60)
        params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
        r.kill()
        res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16], timeout=20)
        assert res.bad_blocks == set(range(10, 16))
        assert d.metrics()["kv_load_failures{kind=peer_unreachable}"] == 1
        assert load(d, Req("x", PROMPT), IDS, timeout=20).num_tokens == 0        # lookup: a clean miss
        prefill(p, Req("s1", [9] * len(PROMPT)), IDS)                            # first save fails ...
        p.flush()
        prefill(p, Req("s2", [5] * len(PROMPT)), IDS)                            # ... later ones are skipped
        p.flush()
        m = p.metrics()
        assert m["kv_saves_skipped"] >= 12 and m["kv_store_errors"] >= 1
        r.start()                                                                # back: decode works again
        d2 = create_connector("redis", "decode", {"url": r.url}, SPEC)
        d2.register_kv_caches(make_cache())
        p2 = create_connector("redis", "prefill", {"url": r.url}, SPEC)
        p2.register_kv_caches(p.kv_cache)
        params = prefill(p2, Req("r2", PROMPT, {"do_remote_decode": True}), IDS)
        assert not load(d2, Req("r2", PROMPT, params), [10, 11, 12, 13, 14, 15, 16]).bad_blocks


def test_unresponsive_redis_times_out_cleanly():
    """A server that accepts connections but never answers: loads fail as timeouts, lookups miss, nothing hangs."""
    import socket

    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(16)
        url = f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0"
        d = create_connector("redis", "decode", {"url": url, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5}, SPEC)
        d.register_kv_caches(make_cache())
        req = Req("r", PROMPT)
        params = resign({"do_remote_prefill": True, "fingerprint": SPEC.fingerprint(),
                         "block_hashes": [h.hex() for h in req.block_hashes]})
        res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16], timeout=20)
        assert res.bad_blocks == set(range(10, 16)) and d.metrics()["kv_load_failures{kind=timeout}"] == 1
        assert load(d, Req("x", PROMPT), [1, 2, 3, 4, 5, 6, 7], timeout=20).num_tokens == 0


def test_redis_dying_mid_pipelined_load_keeps_the_verified_prefix():
    """Records come in chunks of two, the next chunk in flight while one is verified. Redis dies right after answering
    the first chunk: those blocks load bit-exact, every later block is a load error (the engine cuts the prompt
    there and recomputes the rest), nothing hangs. (Main fetched everything in one round trip: no partial load.)"""
    with redis_server() as r:
        p, d = _pair(r.url, fetch_chunk=2)
        params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), IDS)
        real_get_many, calls = d.store.get_many, []

        def get_many_then_die(hashes):
            out = real_get_many(hashes)
            calls.append(len(hashes))
            if len(calls) == 1:
                r.kill()
            return out

        d.store.get_many = get_many_then_die
        res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15, 16], timeout=20)
        assert calls[0] == 2 and res.num_tokens == 6 * BLOCK
        assert res.bad_blocks == {12, 13, 14, 15}
        assert all(torch.equal(p.kv_cache[s], d.kv_cache[t]) for s, t in zip(IDS[:2], [10, 11]))
        assert d.metrics()["kv_load_failures{kind=peer_unreachable}"] == 1 and d.metrics()["kv_blocks_loaded"] == 2


def test_handoff_blocks_stay_allocated_while_a_stuck_writer_reads_them(server):
    """A handoff's background saves read its live blocks (no snapshot copy). When the writer is stuck past the
    handoff's wait, request_finished keeps the blocks (delay_free) and frees them only once the writer is done, so
    the engine never reuses blocks a late write would store under the old hashes."""
    import threading

    p, _ = _pair(server.url, handoff_timeout_s=0.2)
    real_put_many, gate, calls = p.store.put_many, threading.Event(), []

    def stuck_once(items):
        calls.append(len(items))
        if len(calls) == 1:
            assert gate.wait(30)
        return real_put_many(items)

    p.store.put_many = stuck_once
    req = Req("stuck", PROMPT, {"do_remote_decode": True})
    p.request_scheduled_for_save(req, IDS, len(PROMPT))       # queued: the writer blocks on the first put
    delay, params = p.request_finished(req, IDS)              # its wait times out; the blocks are written again now
    assert delay is True and params["block_hashes"]
    assert "stuck" not in p.get_finished()[0]
    gate.set()
    p.flush()
    assert p.get_finished()[0] == {"stuck"}
    p.shutdown()


def test_a_full_redis_refuses_the_save_cleanly_and_the_store_stays_usable(server):
    """Redis answers every SET with an error reply (maxmemory reached, noeviction): the save is counted as skipped,
    never a crash, and the store's next calls work: the connection left with unread replies is dropped, not reused."""
    admin = redis.Redis.from_url(server.url)
    p, _ = _pair(server.url, key_prefix="full:")
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        prefill(p, Req("full", PROMPT), IDS)
        p.flush()
    finally:
        admin.config_set("maxmemory", 0)
    m = p.metrics()
    assert (m["kv_blocks_saved"], m["kv_saves_skipped"], m["kv_store_errors"]) == (0, 6, 1)
    assert not admin.keys("full:*")
    record = p.store.get_many([b"\0" * 32])   # the same store, memory back: a miss, then a write and a read
    items = [(b"\1" * 32, b"head", memoryview(b"payload" * 1000))]
    p.store.put_many(items)
    assert record == [None] and p.store.get_many([b"\1" * 32]) == [b"head" + b"payload" * 1000]
