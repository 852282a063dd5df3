"""KV event publisher against real ZMQ SUB and DEALER sockets on loopback (no model needed)."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.runtime.kv_event_publisher import END_SEQ, KVEventPublisher, seq_bytes
from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from tests.support.server import free_port


@pytest.fixture
def publisher():
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher("127.0.0.1", port, replay_port=replay_port, buffer_size=3)
    yield pub, port, replay_port
    pub.close()


def _subscribe(ctx: zmq.Context, port: int) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", seq_bytes(start)])
    got = []
    while True:
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            break
        got.append((int.from_bytes(seq, "big"), payload))
    dealer.close()
    return got


def test_publish_sequence_and_decode(publisher):
    pub, port, _ = publisher
    ctx = zmq.Context()
    sub = _subscribe(ctx, port)
    stored = BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16)
    # PUB drops messages until the subscription propagates (slow joiner): publish probes until one arrives
    deadline = time.monotonic() + 10
    while True:
        pub.publish([AllBlocksCleared()])
        try:
            sub.recv_multipart(flags=zmq.NOBLOCK)
            break
        except zmq.Again:
            assert time.monotonic() < deadline, "subscriber never connected"
            time.sleep(0.05)
    while sub.poll(200):
        sub.recv_multipart()
    first = pub.publish([stored, BlockRemoved([b"\x03" * 32])])
    assert pub.publish([]) is None
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv-events" and int.from_bytes(seq, "big") == first
    batch = decode_batch(payload)
    assert batch.events == [stored, BlockRemoved([b"\x03" * 32])]
    second = pub.publish([AllBlocksCleared()])
    assert second == first + 1
    assert int.from_bytes(sub.recv_multipart()[1], "big") == second
    sub.close()
    ctx.term()


def test_replay_from_sequence_with_bounded_buffer(publisher):
    pub, _, replay_port = publisher
    for i in range(5):
        pub.publish([BlockRemoved([bytes([i]) * 32])])
    ctx = zmq.Context()
    got = _replay(ctx, replay_port, 3)
    assert [s for s, _ in got] == [3, 4]
    assert decode_batch(got[0][1]).events == [BlockRemoved([b"\x03" * 32])]
    # only the last 3 batches are retained: asking from 0 returns 2, 3, 4
    assert [s for s, _ in _replay(ctx, replay_port, 0)] == [2, 3, 4]
    assert _replay(ctx, replay_port, 99) == []
    ctx.term()


def test_malformed_replay_request_gets_end_marker(publisher):
    _, _, replay_port = publisher
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", b"abc"])
    assert dealer.recv_multipart() == [b"", END_SEQ, b""]
    dealer.close()
    ctx.term()
