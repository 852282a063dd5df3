"""NIXL connector with real agents (UCX over loopback): two engines' connectors in one process, plus a prefill in a
separate process for the cross-process READ and the "prefill died after it answered" fault."""

import json
import socket
import subprocess
import sys
import time

import pytest
import torch

from pdserve.kv_connectors import side_channel
from pdserve.kv_connectors.base import KVCacheSpec, create_connector
from tests.kv.conftest import BLOCK, SPEC, Req, load, make_cache, prefill, resign
from tests.support.deps import require
from tests.support.server import free_port

require("nixl_cu12", "nixl-cu12 is not installed")

TOKEN = "test-kv-token"
PROMPT = list(range(7, 7 + 5 * BLOCK + 3))      # 5 full blocks + 3 tokens
SRC, DST = [2, 4, 6, 8, 10, 12], [20, 21, 22, 23, 24, 25]


def _conn(role, **extra):
    c = create_connector("nixl", role, {"token": TOKEN, "load_timeout_s": 5, "handshake_timeout_s": 2, **extra}, SPEC)
    c.register_kv_caches(make_cache(fill=role == "prefill"))
    return c


@pytest.fixture(scope="module")
def decode():
    d = _conn("decode")
    yield d
    d.shutdown()


@pytest.fixture
def prefill_conn():
    p = _conn("prefill")
    yield p
    p.shutdown()


def _handoff(p, rid="r"):
    return prefill(p, Req(rid, PROMPT, {"do_remote_decode": True}), SRC)


def _delta(d, before, key):
    return d.metrics().get(key, 0) - before.get(key, 0)


def test_read_blocks_and_release_lease(prefill_conn, decode):
    p = prefill_conn
    params = _handoff(p)
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.port and params["tp_size"] == 1
    assert params["remote_block_ids"] == SRC[:5] and params["lease_id"]
    delay, _ = p.request_finished(Req("plain", PROMPT), SRC)             # no do_remote_decode: nothing held
    assert delay is False
    res = load(decode, Req("r", PROMPT, params), DST)
    assert res.num_tokens == 5 * BLOCK and res.is_async and not res.bad_blocks
    assert all(torch.equal(p.kv_cache[s], decode.kv_cache[t]) for s, t in zip(SRC, DST[:5]))
    assert p.get_finished()[0] == {"r"}                                 # "done" released the lease


def test_local_prefix_hits_are_skipped(prefill_conn, decode):
    params = _handoff(prefill_conn)
    decode.kv_cache[DST[:2]] = 0
    res = load(decode, Req("r", PROMPT, params), DST, num_local_tokens=2 * BLOCK)
    assert res.num_tokens == 3 * BLOCK and not res.bad_blocks
    assert not decode.kv_cache[DST[:2]].any()                            # local blocks untouched
    assert torch.equal(decode.kv_cache[DST[2]], prefill_conn.kv_cache[SRC[2]])


def test_fingerprint_mismatch_rejected_before_transfer(prefill_conn):
    other = KVCacheSpec(**{**SPEC.__dict__, "model": "another-model"})
    d = create_connector("nixl", "decode", {"token": TOKEN}, other)
    d.register_kv_caches(make_cache(spec=other))
    params = _handoff(prefill_conn)
    res = load(d, Req("r", PROMPT, resign({**params, "fingerprint": other.fingerprint()}, TOKEN)), DST)
    assert res.bad_blocks == set(DST[:5]) and not d.kv_cache.any()
    m = d.metrics()
    assert m["kv_load_failures{kind=fingerprint}"] == 1 and m.get("kv_peer_handshakes", 0) == 0
    d.shutdown()


def test_unreachable_peer_errors_within_timeout(decode):
    with socket.socket() as blackhole:          # accepts connections but never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen()
        before = decode.metrics()
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_engine_id": "x", "lease_id": "l",
                  "remote_block_ids": SRC[:5], "fingerprint": SPEC.fingerprint(),
                  "block_hashes": [h.hex() for h in Req("u", PROMPT).block_hashes]}
        res = load(decode, Req("u", PROMPT, resign({**params, "remote_port": blackhole.getsockname()[1]}, TOKEN)), DST,
                   timeout=30)
        assert res.bad_blocks == set(DST[:5]) and _delta(decode, before, "kv_load_failures{kind=timeout}") == 1
    res = load(decode, Req("u2", PROMPT, resign({**params, "remote_port": free_port()}, TOKEN)), DST, timeout=30)
    assert res.bad_blocks == set(DST[:5]) and _delta(decode, before, "kv_load_failures{kind=peer_unreachable}") == 1


def test_wrong_token_rejected(prefill_conn):
    with pytest.raises(side_channel.SideChannelError, match="unauthorized"):
        side_channel.call("127.0.0.1", prefill_conn.port, b"wrong", "meta")
    d = create_connector("nixl", "decode", {"token": "wrong"}, SPEC)
    d.register_kv_caches(make_cache())
    params = _handoff(prefill_conn)
    res = load(d, Req("r", PROMPT, params), DST)      # params signed with another secret: ignored, nothing dialled
    assert res.num_tokens == 0 and not d.kv_cache.any() and d.metrics()["kv_params_rejected{reason=bad_signature}"] == 1
    res = load(d, Req("r2", PROMPT, resign(params, "wrong")), DST)   # ... and a side channel with another secret
    assert res.bad_blocks == set(DST[:5]) and not d.kv_cache.any()
    assert prefill_conn.metrics()["kv_side_channel_auth_failures"] == 2
    assert side_channel.call("127.0.0.1", prefill_conn.port, TOKEN.encode(), "heartbeat", {"lease_id": "x"},
                             server_engine_id=prefill_conn.engine_id) == {"alive": False}
    d.shutdown()


def test_expired_lease_before_read_is_detected(decode):
    p = _conn("prefill", lease_s=0.2)
    params = _handoff(p)
    time.sleep(0.4)
    assert p.get_finished()[0] == {"r"}                    # the engine frees the blocks ...
    p.kv_cache[SRC] = -1.0                                 # ... and reuses them for another request
    before = decode.metrics()
    res = load(decode, Req("r", PROMPT, params), DST)
    assert res.bad_blocks == set(DST[:5]) and _delta(decode, before, "kv_load_failures{kind=lease_expired}") == 1
    p.shutdown()


def test_lease_expiring_during_the_read_is_detected(decode, monkeypatch):
    """The late-reader race: the read itself succeeds but the blocks were freed and reused while it ran."""
    p = _conn("prefill", lease_s=0.3)
    params = _handoff(p)
    real_read = type(decode)._read

    def slow_read(self, job, peer, local, remote, lease_id, **kw):
        time.sleep(0.5)
        assert p.get_finished()[0] == {"r"}
        p.kv_cache[SRC] = -1.0
        real_read(self, job, peer, local, remote, lease_id, **kw)

    monkeypatch.setattr(type(decode), "_read", slow_read)
    before = decode.metrics()
    res = load(decode, Req("r", PROMPT, params), DST)
    assert res.bad_blocks == set(DST[:5]) and _delta(decode, before, "kv_load_failures{kind=lease_expired}") == 1
    p.shutdown()


def test_corrupted_block_fails_checksum(prefill_conn, decode):
    params = _handoff(prefill_conn)
    prefill_conn.kv_cache[SRC[3], 0, 0, 0, 0, 0] += 1.0    # the block changed after handoff
    before = decode.metrics()
    res = load(decode, Req("r", PROMPT, params), DST)
    assert res.bad_blocks == {DST[3]} and _delta(decode, before, "kv_load_failures{kind=corrupt}") == 1


def test_restarted_peer_is_dropped_and_rehandshaken(decode):
    port = free_port()
    p1 = _conn("prefill", port=port)
    params1 = _handoff(p1)
    assert not load(decode, Req("r", PROMPT, params1), DST).bad_blocks
    p1.shutdown()
    p2 = _conn("prefill", port=port)                         # a new engine on the same address
    before = decode.metrics()
    assert load(decode, Req("r", PROMPT, params1), DST).bad_blocks == set(DST[:5])   # old params: engine gone
    params2 = _handoff(p2)
    res = load(decode, Req("r2", PROMPT, params2), DST)
    assert not res.bad_blocks and torch.equal(decode.kv_cache[DST[0]], p2.kv_cache[SRC[0]])
    assert _delta(decode, before, "kv_peers_dropped") == 1 and _delta(decode, before, "kv_peer_handshakes") == 1
    p2.shutdown()


def test_cross_process_read_then_prefill_dies(decode):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.kv.nixl_peer", str(port), TOKEN, str(len(PROMPT))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("PARAMS "):
            line = proc.stdout.readline()
            assert line, "the prefill process exited before answering"
        params = json.loads(line.removeprefix("PARAMS "))
        torch.manual_seed(1234)
        expected = make_cache(fill=True)                     # the same seeded pattern the peer filled its cache with
        prompt = list(range(len(PROMPT)))
        res = load(decode, Req("remote", prompt, params), DST)
        assert res.num_tokens == 5 * BLOCK and not res.bad_blocks
        assert all(torch.equal(expected[s], decode.kv_cache[t]) for s, t in zip(range(1, 6), DST))
        proc.kill()
        proc.wait(10)
        before = decode.metrics()
        t0 = time.monotonic()
        res = load(decode, Req("remote", prompt, params), DST, timeout=30)
        assert res.bad_blocks == set(DST[:5]) and time.monotonic() - t0 < 30
        assert _delta(decode, before, "kv_load_failures{kind=peer_unreachable}") == 1
    finally:
        proc.kill()
        proc.wait(10)


def test_side_channel_survives_garbage_and_binds_only_its_address(prefill_conn):
    assert prefill_conn.server.host == "127.0.0.1"
    for junk in (b"\xff" * 64, b"\x7f\xff\xff\xff" + b"x" * 10, b""):        # bad msgpack, a 2 GiB length, nothing
        with socket.create_connection(("127.0.0.1", prefill_conn.port), timeout=5) as s:
            s.recv(4096)                                                   # the challenge
            s.settimeout(5)
            try:  # the server may drop the connection as soon as it sees the junk: any OSError here is fine
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except OSError:
                pass
    meta = side_channel.call("127.0.0.1", prefill_conn.port, TOKEN.encode(), "meta",
                             server_engine_id=prefill_conn.engine_id)
    assert meta["engine_id"] == prefill_conn.engine_id and meta["fingerprint"] == SPEC.fingerprint()


def test_forged_params_cannot_read_or_cache_other_blocks(prefill_conn, decode):
    """A client that edits kv_transfer_params (other block ids, or another prompt's hashes with a valid lease) gets a
    load error, never another request's KV under its own hashes; the lease stays usable by its rightful reader."""
    p = prefill_conn
    other = list(range(500, 500 + len(PROMPT)))
    params = _handoff(p)
    forged_hashes = {**params, "block_hashes": [h.hex() for h in Req("x", other).block_hashes]}
    forged_ids = {**params, "remote_block_ids": [1, 3, 5, 7, 9]}
    no_lease = {k: v for k, v in params.items() if k != "lease_id"}
    before = decode.metrics()
    for rid, prompt, forged in (("f1", other, forged_hashes), ("f2", PROMPT, forged_ids), ("f3", PROMPT, no_lease)):
        assert load(decode, Req(rid, prompt, forged), DST).num_tokens == 0          # the signature no longer matches
    assert _delta(decode, before, "kv_params_rejected{reason=bad_signature}") == 3
    assert _delta(decode, before, "kv_peer_handshakes") == 0
    # Even edits signed with the secret (a compromised prefill) cannot read blocks outside the lease:
    assert load(decode, Req("f1", other, resign(forged_hashes, TOKEN)), DST).bad_blocks == set(DST[:5])
    assert load(decode, Req("f2", PROMPT, resign(forged_ids, TOKEN)), DST).bad_blocks == set(DST[:5])
    assert load(decode, Req("f3", PROMPT, resign(no_lease, TOKEN)), DST).num_tokens == 0   # no lease: computed locally
    assert _delta(decode, before, "kv_load_failures{kind=corrupt}") == 2
    res = load(decode, Req("r", PROMPT, params), DST)                              # the real reader still succeeds
    assert not res.bad_blocks and torch.equal(decode.kv_cache[DST[4]], p.kv_cache[SRC[4]])


def test_pipelined_read_cuts_at_the_damaged_block_and_keeps_the_rest_exact(prefill_conn):
    """Chunks of one block, two in flight: each chunk is verified while later ones move. A block damaged after the
    handoff (in the middle of the pipeline) is reported bad (the engine cuts the prefix there and recomputes), every
    other block arrives bit-exact, and a later clean handoff through the same pipeline is whole."""
    d = _conn("decode", chunk_blocks=1, max_inflight=2)
    try:
        params = _handoff(prefill_conn)
        prefill_conn.kv_cache[SRC[2]].view(-1)[-1] += 1.0
        res = load(d, Req("r", PROMPT, params), DST)
        assert res.num_tokens == 5 * BLOCK and res.bad_blocks == {DST[2]}
        assert all(torch.equal(prefill_conn.kv_cache[s], d.kv_cache[t]) for s, t in zip(SRC, DST[:5]))
        assert d.metrics()["kv_load_failures{kind=corrupt}"] == 1
        res = load(d, Req("r2", PROMPT, _handoff(prefill_conn, "r2")), DST)
        assert not res.bad_blocks and all(torch.equal(prefill_conn.kv_cache[s], d.kv_cache[t])
                                          for s, t in zip(SRC, DST[:5]))
    finally:
        d.shutdown()


def test_checksums_are_of_the_blocks_as_computed_not_as_read(prefill_conn, decode):
    """Blocks are hashed as the engine reports them computed (off its thread); a block that changes afterwards, before
    the handoff, is caught by the decode side (main hashed only at the handoff, so missed it)."""
    req = Req("early", PROMPT, {"do_remote_decode": True})
    prefill_conn.request_scheduled_for_save(req, SRC, 2 * BLOCK + 1)          # a first chunk: blocks 0-1 computed
    for _, fut in prefill_conn._hashing["early"][1]:                          # hashed by now (hash threads)
        fut.result(timeout=60)
    prefill_conn.kv_cache[SRC[1]].view(-1)[0] += 1.0                          # then block 1 changes under it
    params = prefill(prefill_conn, req, SRC)
    res = load(decode, Req("early", PROMPT, params), DST)
    assert res.bad_blocks == {DST[1]}


def test_handoff_checksums_run_off_the_caller_and_fall_back_at_their_deadline(monkeypatch, decode):
    """The handoff's checksums run on the connector's handoff thread: start_request_finished returns at once, pending.
    Past ``handoff_timeout_s`` the params list no blocks and no lease (the decode side computes the prompt itself),
    and the blocks stay held until the stuck hash really ends."""
    import threading

    from pdserve.kv_connectors import nixl_connector

    gate, entered = threading.Event(), threading.Event()
    real = nixl_connector.block_checksums

    def stuck(*args):
        entered.set()
        gate.wait(60)
        return real(*args)

    monkeypatch.setattr(nixl_connector, "block_checksums", stuck)
    p = _conn("prefill", handoff_timeout_s=0.3)
    try:
        delay, params, pending = p.start_request_finished(Req("h", PROMPT, {"do_remote_decode": True}), SRC)
        assert delay and pending and params is None
        assert entered.wait(30)
        deadline = time.monotonic() + 30
        while not (done := p.get_finished_handoffs()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        params = done["h"]
        assert params["remote_block_ids"] == [] and "lease_id" not in params and params["do_remote_prefill"]
        assert p.metrics()["kv_handoffs_failed"] == 1 and len(p.leases) == 0
        res = load(decode, Req("h", PROMPT, params), DST)
        assert res.num_tokens == 0                                 # nothing claimed: decode recomputes
        assert "h" not in p.get_finished()[0]                      # the hash still reads the blocks
        gate.set()
        p.handoffs.flush(30)
        assert p.get_finished()[0] == {"h"}
    finally:
        gate.set()
        p.shutdown()
