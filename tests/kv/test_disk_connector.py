"""Disk connector with a real directory, driven through the connector contract."""

import os
import threading
import time

import pytest
import torch

from pdserve.kv_connectors import block_codec
from pdserve.kv_connectors.base import create_connector
from pdserve.kv_connectors.disk_connector import DiskStore
from pdserve.kv_connectors.load_errors import KVLoadError
from tests.kv.conftest import BLOCK, SPEC, Req, load, make_cache, prefill, resign, slow_record

PROMPT = list(range(100, 100 + 5 * BLOCK + 2))   # 5 full blocks + 2 tokens


def _pair(tmp_path, **extra):
    cfg = {"path": str(tmp_path), **extra}
    p, d = create_connector("disk", "prefill", cfg, SPEC), create_connector("disk", "decode", cfg, SPEC)
    p.register_kv_caches(make_cache(fill=True))
    d.register_kv_caches(make_cache())
    return p, d


def _block_files(tmp_path):
    return sorted((tmp_path / SPEC.fingerprint()).glob("*/*.kvb"))


def test_handoff_round_trip_and_params(tmp_path):
    p, d = _pair(tmp_path)
    src = [3, 7, 1, 9, 4, 11]
    params = prefill(p, Req("r1", PROMPT, {"do_remote_decode": True}), src)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == src[:5] and len(params["block_hashes"]) == 5
    assert len(_block_files(tmp_path)) == 5
    dst = [20, 21, 22, 23, 24, 25]
    res = load(d, Req("r1", PROMPT, params), dst)
    assert res.num_tokens == 5 * BLOCK and res.is_async and not res.bad_blocks
    for s, t in zip(src[:5], dst[:5]):
        assert torch.equal(p.kv_cache[s], d.kv_cache[t])
    assert d.metrics()["kv_blocks_loaded"] == 5 and p.metrics()["kv_blocks_saved"] == 5


def test_last_full_block_loaded_and_local_hits_skipped(tmp_path):
    p, d = _pair(tmp_path)
    prompt = list(range(4 * BLOCK))                 # exactly 4 blocks: the 4th holds the last token
    params = prefill(p, Req("r", prompt, {"do_remote_decode": True}), [1, 2, 3, 4])
    res = load(d, Req("r", prompt, params), [5, 6, 7, 8], num_local_tokens=BLOCK)
    # blocks 1, 2, 3 (block 0 local; block 3 too, though it holds the last token: the engine recomputes only that one)
    assert res.num_tokens == 3 * BLOCK
    assert torch.equal(d.kv_cache[6], p.kv_cache[2]) and torch.equal(d.kv_cache[7], p.kv_cache[3])
    assert torch.equal(d.kv_cache[8], p.kv_cache[4])
    assert not d.kv_cache[5].any()


def test_shared_prefix_cache_without_params(tmp_path):
    p, d = _pair(tmp_path, async_load=False)
    prefill(p, Req("a", PROMPT), [1, 2, 3, 4, 5, 6])
    p.flush()
    other = PROMPT[: 3 * BLOCK] + [7] * (2 * BLOCK)  # shares 3 blocks, then diverges
    res = load(d, Req("b", other), [10, 11, 12, 13, 14])
    assert (res.num_tokens, res.is_async, res.bad_blocks) == (3 * BLOCK, False, set())
    assert torch.equal(d.kv_cache[12], p.kv_cache[3])


@pytest.mark.parametrize("fault, kind", [("delete", "missing"), ("corrupt", "corrupt"), ("truncate", "corrupt")])
def test_damaged_block_reported_as_load_error(tmp_path, fault, kind):
    p, d = _pair(tmp_path)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), [1, 2, 3, 4, 5, 6])
    victim = (tmp_path / SPEC.fingerprint() / params["block_hashes"][2][:2] / f"{params['block_hashes'][2]}.kvb")
    data = victim.read_bytes()
    if fault == "delete":
        victim.unlink()
    elif fault == "corrupt":
        victim.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    else:
        victim.write_bytes(data[: len(data) // 2])
    res = load(d, Req("r", PROMPT, params), [10, 11, 12, 13, 14, 15])
    assert res.bad_blocks == {12}
    m = d.metrics()
    assert m[f"kv_load_failures{{kind={kind}}}"] == 1 and m["kv_blocks_loaded"] == 4
    assert not victim.exists()                            # a damaged record is deleted ...
    params = prefill(p, Req("r2", PROMPT, {"do_remote_decode": True}), [1, 2, 3, 4, 5, 6])
    assert victim.exists()                                # ... so the next handoff writes it again
    assert not load(d, Req("r2", PROMPT, params), [10, 11, 12, 13, 14, 15]).bad_blocks


def test_fingerprint_mismatch_fails_every_block(tmp_path):
    p, d = _pair(tmp_path)
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), [1, 2, 3, 4, 5, 6])
    res = load(d, Req("r", PROMPT, resign({**params, "fingerprint": "0" * 32})), [10, 11, 12, 13, 14, 15])
    assert res.bad_blocks == {10, 11, 12, 13, 14}
    assert d.metrics()["kv_load_failures{kind=fingerprint}"] == 1


def test_lru_cap_evicts_least_recently_used(tmp_path):
    rec = SPEC.block_bytes + block_codec.HEADER_SIZE
    store = DiskStore(tmp_path, "fp", max_bytes=int(rec * 4.5))
    blk = torch.zeros(SPEC.num_layers, 2, BLOCK, SPEC.num_kv_heads, SPEC.head_dim)
    hashes = [bytes([i]) * 32 for i in range(6)]
    for i, h in enumerate(hashes[:4]):
        pl = block_codec.tensor_bytes(blk)
        store.put_many([(h, block_codec.encode_header(blk, "fp", h, pl), pl)])
        os.utime(store._path(h), (1000 + i, 1000 + i))
    store.get_many([hashes[0]])                           # a read makes block 0 the most recently used
    for h in hashes[4:]:
        pl = block_codec.tensor_bytes(blk)
        store.put_many([(h, block_codec.encode_header(blk, "fp", h, pl), pl)])
    present = store.contains_many(hashes)
    assert present[0] and present[5] and not present[1]
    assert sum(f.stat().st_size for f in tmp_path.glob("fp/*/*.kvb")) <= rec * 4.5


def test_atomic_writes_never_expose_partial_records(tmp_path):
    """A reader racing many rewrites of the same block sees a complete, valid record or nothing."""
    p, d = _pair(tmp_path)
    req = Req("r", PROMPT, {"do_remote_decode": True})
    params = prefill(p, req, [1, 2, 3, 4, 5, 6])
    stop, errors = threading.Event(), []

    def writer():
        while not stop.is_set():
            p._write("w", req.block_hashes[:5], p.kv_cache[torch.tensor([1, 2, 3, 4, 5])].clone())

    t = threading.Thread(target=writer)
    t.start()
    try:
        for i in range(30):
            res = load(d, Req(f"r{i}", PROMPT, params), [10, 11, 12, 13, 14, 15])
            errors += list(res.bad_blocks)
    finally:
        stop.set()
        t.join()
    assert errors == [] and not list(tmp_path.glob("**/.tmp-*"))


def test_load_stuck_past_its_deadline_keeps_its_blocks_until_the_read_returns(tmp_path):
    """Blocks are read straight into the cache: a read stuck mid-block (a FIFO record) past the load's deadline stops
    the load from starting other reads, but the load is reported finished (blocks invalid, timed out) and its blocks
    given back - here after the request was aborted - only when the read has returned and written its last byte."""
    p, d = _pair(tmp_path, load_timeout_s=0.2, read_threads=1)      # watchdog: 2 * 0.2 + 1 = 1.4 s
    ids = [10, 11, 12, 13, 14, 15]
    params = prefill(p, Req("r", PROMPT, {"do_remote_decode": True}), [1, 2, 3, 4, 5, 6])
    victim = tmp_path / SPEC.fingerprint() / params["block_hashes"][0][:2] / f"{params['block_hashes'][0]}.kvb"
    go, done = slow_record(victim, victim.read_bytes(), block_codec.HEADER_SIZE + SPEC.block_bytes // 2)
    req = Req("r", PROMPT, params)
    try:
        n, is_async = d.get_num_new_matched_tokens(req, 0)
        assert (n, is_async) == (5 * BLOCK, True)
        d.update_state_after_alloc(req, ids, n)
        d.start_load_kv(d.build_connector_meta())
        assert d._running["r"].in_place
        end = time.monotonic() + 2.2
        while time.monotonic() < end:                               # well past the deadline: still loading
            assert d.get_finished() == (set(), set())
            time.sleep(0.02)
        assert d.metrics()["kv_loads_overdue"] == 1 and not done.is_set()
        assert d.start_request_finished(req, ids) == (True, None, False)   # aborted: its blocks stay held ...
        time.sleep(0.3)
        assert d.get_finished() == (set(), set())                    # ... while the read still writes block 10
    finally:
        go.set()
    sending, recving, end = set(), set(), time.monotonic() + 10
    while "r" not in recving:
        s, r = d.get_finished()
        sending, recving = sending | s, recving | r
        assert time.monotonic() < end, "the load never ended"
        time.sleep(0.01)
    assert sending == {"r"}                                          # released once the read had returned:
    assert torch.equal(d.kv_cache[10], p.kv_cache[1])               # it wrote its last byte before that
    assert not d.kv_cache[11:15].any()                               # no read started after the deadline
    assert d.get_block_ids_with_load_errors() == {10, 11, 12, 13, 14}   # and none of it is used
    assert d.metrics()["kv_load_failures{kind=timeout}"] == 1 and d.metrics()["kv_blocks_loaded"] == 0


def test_load_queued_behind_a_stuck_read_is_reported_at_its_deadline(tmp_path):
    """Only a read in flight holds a load past its deadline: a second load whose reads wait behind the stuck one (one
    reader thread) has none, so it is reported timed out at its deadline, its blocks untouched, while the first one
    stays held until its read returns."""
    p, d = _pair(tmp_path, load_timeout_s=0.2, read_threads=1)
    other = [t + 1000 for t in PROMPT]
    pa = prefill(p, Req("a", PROMPT, {"do_remote_decode": True}), [1, 2, 3, 4, 5, 6])
    pb = prefill(p, Req("b", other, {"do_remote_decode": True}), [7, 8, 9, 10, 11, 12])
    victim = tmp_path / SPEC.fingerprint() / pa["block_hashes"][0][:2] / f"{pa['block_hashes'][0]}.kvb"
    go, _ = slow_record(victim, victim.read_bytes(), block_codec.HEADER_SIZE + SPEC.block_bytes // 2)
    try:
        for rid, toks, params, ids in (("a", PROMPT, pa, [10, 11, 12, 13, 14, 15]),
                                       ("b", other, pb, [20, 21, 22, 23, 24, 25])):
            req = Req(rid, toks, params)
            n, _ = d.get_num_new_matched_tokens(req, 0)
            d.update_state_after_alloc(req, ids, n)
            d.start_load_kv(d.build_connector_meta())
        recving, bad, end = set(), set(), time.monotonic() + 10
        while "b" not in recving:
            recving |= d.get_finished()[1]
            bad |= d.get_block_ids_with_load_errors()
            assert time.monotonic() < end, "the queued load was never reported"
            time.sleep(0.01)
        assert recving == {"b"} and bad == {20, 21, 22, 23, 24} and not d.kv_cache[20:25].any()
        time.sleep(0.3)
        assert d.get_finished() == (set(), set())                    # "a" still has its read in flight
    finally:
        go.set()
    end = time.monotonic() + 10
    while "a" not in d.get_finished()[1]:
        assert time.monotonic() < end, "the stuck load was never reported"
        time.sleep(0.01)
    assert torch.equal(d.kv_cache[10], p.kv_cache[1]) and d.metrics()["kv_loads_overdue"] == 1


def test_a_load_is_traced_as_verified(tmp_path):
    """Store records carry a checksum that every load checks: the request's kv_transfer record (the tracing span's
    ``pdserve.kv.verified``) says so."""
    p, d = _pair(tmp_path)
    params = prefill(p, Req("v1", PROMPT, {"do_remote_decode": True}), [3, 7, 1, 9, 4, 11])
    req = Req("v1", PROMPT, params)
    req.kv_transfer = {}
    res = load(d, req, [20, 21, 22, 23, 24, 25])
    assert res.num_tokens == 5 * BLOCK and not res.bad_blocks
    assert req.kv_transfer["verified"] is True and req.kv_transfer["failed_blocks"] == 0
    p.shutdown()
    d.shutdown()


LONG = list(range(300, 300 + 24 * BLOCK + 2))   # 24 full blocks: enough for the save to be split over its put threads


def _record_puts(store, fail_at: bytes | None = None, meet: int = 0) -> list[tuple[str, int]]:
    """Wrap ``store.put_many`` (the real one still writes): (thread name, records) per call; with ``fail_at``, the call
    holding that hash writes the records before it, then fails as a full disk does. With ``meet``, each call first
    waits (10 s at most) until that many calls are in flight at once: shares written one after another on one thread
    never meet, and are recorded as ``"apart"``."""
    calls, real = [], store.put_many
    barrier = threading.Barrier(meet, timeout=10) if meet else None

    def put_many(items):
        try:
            if barrier is not None:
                barrier.wait()
            calls.append((threading.current_thread().name, len(items)))
        except threading.BrokenBarrierError:
            calls.append(("apart", len(items)))
        hashes = [h for h, _, _ in items]
        if fail_at in hashes:
            real(items[:hashes.index(fail_at)])
            raise KVLoadError("disk write failed: [Errno 28] No space left on device")
        real(items)

    store.put_many = put_many
    return calls


def test_a_long_save_is_hashed_and_written_by_several_threads_and_loads_back_exactly(tmp_path):
    if DiskStore.put_threads < 2:
        pytest.skip("one CPU: the disk store writes on the save thread alone")
    p, d = _pair(tmp_path)
    shares = min(DiskStore.put_threads, 24 // 8)   # all of them must be in flight at once (not left to the scheduler)
    calls = _record_puts(p.store, meet=shares)
    src, dst = list(range(1, 26)), list(range(1, 26))[::-1]
    params = prefill(p, Req("r", LONG, {"do_remote_decode": True}), src)
    names = [name for name, _ in calls]
    assert len(set(names)) == shares and "apart" not in names and sum(n for _, n in calls) == 24, calls   # every block once
    assert len(_block_files(tmp_path)) == 24 and p.metrics()["kv_blocks_saved"] == 24
    res = load(d, Req("r", LONG, params), dst)
    assert res.num_tokens == 24 * BLOCK and not res.bad_blocks
    assert all(torch.equal(p.kv_cache[s], d.kv_cache[t]) for s, t in zip(src[:24], dst[:24]))


def test_a_share_that_fails_mid_write_cuts_the_prefix_at_its_first_missing_block(tmp_path):
    """The disk fills up during the first thread's share: the blocks it wrote before the error stay usable, its others
    count as skipped (never as saved), the store is skipped for a while, and a later load takes the prefix up to the
    first missing block only (the second share's blocks, though written, lie past the cut and are recomputed)."""
    if DiskStore.put_threads < 2:
        pytest.skip("one CPU: the disk store writes on the save thread alone")
    p, d = _pair(tmp_path, async_load=False)
    req = Req("a", LONG)
    calls = _record_puts(p.store, fail_at=req.block_hashes[3])
    prefill(p, req, list(range(1, 26)))
    p.flush()
    shares = sorted(n for _, n in calls)
    m = p.metrics()
    assert len(shares) >= 2 and sum(shares) == 24
    assert m["kv_blocks_saved"] == 24 - shares[-1] and m["kv_saves_skipped"] == shares[-1] and m["kv_store_errors"] == 1
    assert len(_block_files(tmp_path)) == 24 - shares[-1] + 3
    res = load(d, Req("b", LONG), list(range(1, 26)))
    assert (res.num_tokens, res.bad_blocks) == (3 * BLOCK, set())
    assert all(torch.equal(d.kv_cache[b], p.kv_cache[b]) for b in (1, 2, 3))
