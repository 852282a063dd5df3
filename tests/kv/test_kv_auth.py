"""The KV secret's building blocks without a model: signed params (every field covered), handoff headers, the side
channel's identity-bound mutual authentication (a relay fails both ways), and the bounds on side-channel connections
and on the store writer's queue. Real sockets, real side-channel servers, a real disk store."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest

from pdserve.kv_connectors import kv_auth, side_channel
from pdserve.kv_connectors.base import create_connector
from tests.kv.conftest import SPEC, Req, make_cache

SECRET = b"deployment-secret"
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "pdserve-e1",
          "remote_block_ids": [3, 4], "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5600,
          "tp_size": 1, "connector": "nixl", "fingerprint": "f" * 32, "block_hashes": ["aa" * 32, "bb" * 32],
          "checksum_algo": 1, "block_checksums": ["1f", "2e"], "lease_id": "l" * 32, "lease_ms": 30000}


def test_every_field_is_signed():
    signed = kv_auth.sign_params(PARAMS, SECRET, 30)
    assert kv_auth.verify_params(signed, SECRET) is None
    for key in [*PARAMS, kv_auth.EXPIRES_FIELD]:
        value = signed[key]
        edited = {**signed, key: (value + 1 if isinstance(value, int) and not isinstance(value, bool)
                                  else [*value, value[0]] if isinstance(value, list) else not value
                                  if isinstance(value, bool) else value + "x")}
        assert kv_auth.verify_params(edited, SECRET) == "bad_signature", key
    assert kv_auth.verify_params({**signed, "extra": 1}, SECRET) == "bad_signature"
    assert kv_auth.verify_params({k: v for k, v in signed.items() if k != "lease_id"}, SECRET) == "bad_signature"
    assert kv_auth.verify_params(signed, b"another deployment") == "bad_signature"
    assert kv_auth.verify_params(PARAMS, SECRET) == "unsigned"
    assert kv_auth.verify_params(["not", "a", "dict"], SECRET) == "malformed"
    assert kv_auth.verify_params({**signed, "lease_ms": float("nan")}, SECRET) == "malformed"
    assert kv_auth.verify_params(kv_auth.sign_params(PARAMS, SECRET, -60), SECRET) == "expired"


def test_signature_survives_a_json_router():
    """Routers copy params through JSON (key order, spacing, 30000 -> 30000.0 may change): still valid."""
    import json

    signed = kv_auth.sign_params(PARAMS, SECRET, 30)
    copied = json.loads(json.dumps(dict(reversed(list(signed.items()))), indent=2))
    copied["lease_ms"] = float(copied["lease_ms"])
    assert kv_auth.verify_params(copied, SECRET) is None


def test_handoff_header_binds_secret_body_and_time():
    body = b'{"prompt": "hi", "kv_transfer_params": {"do_remote_decode": true}}'
    header = kv_auth.handoff_header(SECRET, body)
    assert kv_auth.check_handoff_header(SECRET, header, body)
    assert not kv_auth.check_handoff_header(SECRET, header, body + b" ")
    assert not kv_auth.check_handoff_header(b"other", header, body)
    assert not kv_auth.check_handoff_header(SECRET, kv_auth.handoff_header(SECRET, body, now=time.time() - 600), body)
    for junk in (None, "", "v1", "v1:x:y", "v2:1:2", header.upper()):
        assert not kv_auth.check_handoff_header(SECRET, junk, body)
    assert kv_auth.handoff_denial(SECRET, None, body, api_key_ok=False)
    assert kv_auth.handoff_denial(SECRET, None, body, api_key_ok=True) is None
    assert kv_auth.handoff_denial(None, None, body, api_key_ok=False) is None     # explicitly insecure


def test_connector_refuses_to_start_without_a_secret(monkeypatch):
    monkeypatch.delenv("PDSERVE_KV_TOKEN", raising=False)
    for name, config in (("disk", {"path": "/tmp/unused-kv"}), ("nixl", {})):
        with pytest.raises(kv_auth.MissingSecret, match="PDSERVE_KV_TOKEN.*--kv-insecure"):
            create_connector(name, "decode", config, SPEC)


@pytest.fixture
def server():
    s = side_channel.SideChannelServer("127.0.0.1", 0, SECRET, lambda op, body: {"op": op, "agent_metadata": b"AGENT"},
                                       timeout=2, engine_id="prefill-1", advertise_host="127.0.0.1", max_connections=3)
    failures = []
    s.on_auth_failure = lambda: failures.append(1)
    s.failures = failures
    yield s
    s.close()


def _call(port, **kw):
    return side_channel.call("127.0.0.1", port, SECRET, "meta", {}, 2, client_id="decode-1", **kw)


class Relay:
    """An attacker between a decode client and the real prefill: passes every frame through unchanged (it cannot
    sign anything itself) and records the server's answers."""

    def __init__(self, target_port: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port, self.target, self.answers = self.sock.getsockname()[1], target_port, []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.sock.accept()
        with client, socket.create_connection(("127.0.0.1", self.target), timeout=5) as up:
            deadline = time.monotonic() + 5
            client.sendall(_frame(side_channel._recv(up, deadline)))       # the real server's nonce, to the victim
            up.sendall(_frame(side_channel._recv(client, deadline)))       # the victim's MAC'd request, to the server
            answer = side_channel._recv(up, deadline)
            self.answers.append(answer)
            client.sendall(_frame(answer))

    def close(self) -> None:
        self.sock.close()


def _frame(obj) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return side_channel._LEN.pack(len(data)) + data


def test_mutual_authentication_bound_to_identity(server):
    assert _call(server.port, server_engine_id="prefill-1")["agent_metadata"] == b"AGENT"
    assert _call(server.port)["op"] == "meta"                  # engine id taken from the hello, address still bound
    with pytest.raises(side_channel.SideChannelError, match="unauthorized"):
        side_channel.call("127.0.0.1", server.port, b"wrong", "meta", {}, 2)
    with pytest.raises(side_channel.PeerUnreachable, match="gone"):   # another engine answers there: never signed for
        _call(server.port, server_engine_id="prefill-0")
    assert len(server.failures) == 1


def test_relayed_nonce_gets_nothing(server):
    """The decode side, believing it talks to ``prefill-1`` at the relay's address, MACs that address; the real
    prefill checks the MAC against its own address and refuses: the relay never sees agent metadata."""
    relay = Relay(server.port)
    with pytest.raises(side_channel.SideChannelError, match="unauthorized"):
        _call(relay.port, server_engine_id="prefill-1")
    relay.close()
    assert relay.answers == [{"ok": False, "error": "unauthorized"}] and len(server.failures) == 1


def test_forged_answer_is_rejected():
    """A fake side channel (no secret) answering 'meta' or a 'valid' verdict is not believed."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()

    def fake(answer):
        c, _ = lst.accept()
        with c:
            c.sendall(_frame({"v": 2, "nonce": os.urandom(32), "engine_id": "prefill-1"}))
            side_channel._recv(c, time.monotonic() + 5)
            c.sendall(_frame(answer))

    res = msgpack.packb({"ok": True, "result": {"verdict": "valid"}}, use_bin_type=True)
    for answer in ({"ok": True, "result": {"verdict": "valid"}}, {"res": res, "mac": b"\0" * 32}):
        t = threading.Thread(target=fake, args=(answer,), daemon=True)
        t.start()
        with pytest.raises(side_channel.SideChannelError):
            _call(lst.getsockname()[1], server_engine_id="prefill-1")
        t.join(5)
    lst.close()


def test_connections_are_bounded(server):
    """Idle connections beyond ``max_connections`` are closed at once (no thread each); when they go, calls work."""
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
    for s in idle:
        assert s.recv(4096)                                     # each got its challenge: all 3 slots are taken
    busy = []
    server.on_busy = lambda: busy.append(1)
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert extra.recv(4096) == b"" and busy == [1]              # closed without a challenge
    extra.close()
    for s in idle:
        s.close()
    deadline = time.monotonic() + 10
    while True:                                                 # slots free as their threads notice the close
        try:
            assert _call(server.port, server_engine_id="prefill-1")["op"] == "meta"
            break
        except side_channel.PeerUnreachable:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_slow_client_is_cut_at_the_deadline(server):
    """A client trickling a frame byte by byte cannot hold a connection past the server's deadline."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.recv(4096)
    frame, sent = side_channel._LEN.pack(200) + b"x" * 200, 0
    try:
        for b in frame:                                         # ~20 s at this pace; the server allows 2 s
            s.sendall(bytes([b]))
            sent += 1
            time.sleep(0.1)
    except OSError:
        pass                                                    # the server closed on us
    s.close()
    assert sent < len(frame)


def test_store_writer_queue_is_bounded(tmp_path):
    """A store slower than the engine: background saves beyond ``max_pending_save_bytes`` are dropped and counted
    instead of queueing block snapshots without bound; once the store catches up, saves go through again."""
    conn = create_connector("disk", "both", {"path": str(tmp_path), "max_pending_save_bytes": SPEC.block_bytes}, SPEC)
    conn.register_kv_caches(make_cache(fill=True))
    gate, put = threading.Event(), conn.store.put_many

    def stuck_put(items):
        gate.wait(30)
        put(items)

    conn.store.put_many = stuck_put
    for i in range(20):                                          # 20 requests, one block each, while the store hangs
        req = Req(f"r{i}", list(range(100 * i, 100 * i + 5)))
        conn.request_scheduled_for_save(req, [i], 4)
    m = conn.metrics()
    assert m["kv_saves_dropped_queue_full"] == 19 and conn._pending_save_bytes == SPEC.block_bytes
    gate.set()
    conn.flush(30)
    assert conn._pending_save_bytes == 0 and conn.metrics()["kv_blocks_saved"] == 1
    conn.request_scheduled_for_save(Req("late", list(range(5000, 5005))), [25], 4)
    conn.flush(30)
    assert conn.metrics()["kv_blocks_saved"] == 2
    conn.shutdown()


def test_router_drops_client_params_unless_trusted():
    import json

    from pdserve.router.pd import client_body

    body = {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9"}}
    raw = json.dumps(body).encode()
    stripped, data = client_body(body, raw, trusted=False)
    assert "kv_transfer_params" not in stripped and json.loads(data) == {"prompt": "hi"}
    assert client_body(body, raw, trusted=True) == (body, raw)        # --trust-client-kv-params: a router in front
    plain = {"prompt": "hi"}
    assert client_body(plain, b"x", trusted=False) == (plain, b"x")   # nothing to strip: the bytes go as sent
