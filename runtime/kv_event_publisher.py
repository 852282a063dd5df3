"""Publishes KV-cache event batches on ZMQ (PUB) with sequence numbers, and replays retained ones on request (ROUTER).

Wire format (same as vLLM's ``ZmqEventPublisher``, msgpack payloads from ``pdserve.runtime.kv_events``, never pickle):

* PUB ``tcp://host:port``: multipart ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian counter starting at 0 and
  increasing by one per batch, so a subscriber detects gaps.
* ROUTER ``tcp://host:replay_port``: a DEALER sends ``[b"", start_seq]`` (8-byte big-endian); the publisher answers, for every retained batch with ``seq >= start_seq``, ``[b"", seq, payload]``, then the end marker
  ``[b"", (-1 as signed 8-byte big-endian), b""]``. Only the last ``buffer_size`` batches are retained.

``publish`` is called from one thread (the engine loop); replay runs on its own thread with its own socket (ZMQ
sockets are not thread-safe), sharing only the ring buffer under a lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

from pdserve.runtime.kv_events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class KVEventPublisher:
    def __init__(self, host: str, port: int, *, replay_port: int | None = None, topic: str = "kv-events",
                 buffer_size: int = 10_000):
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(f"tcp://{host}:{port}")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_port:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(f"tcp://{host}:{replay_port}")
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True,
                                                   name="kv-events-replay")
            self._replay_thread.start()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: list[KVEvent]) -> int | None:
        """Send one batch (nothing if ``events`` is empty); returns its sequence number."""
        if not events:
            return None
        payload = encode_batch(KVEventBatch(list(events)))
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def _serve_replay(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart()
                identity, rest = frames[0], frames[1:]
                envelope = [identity, b""] if rest and rest[0] == b"" else [identity]
                body = [f for f in rest if f != b""]
                if len(body) != 1 or len(body[0]) != 8:
                    logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
                    sock.send_multipart(envelope + [END_SEQ, b""])
                    continue
                start = int.from_bytes(body[0], "big")
                with self._lock:
                    batches = [(s, p) for s, p in self._buffer if s >= start]
                for s, p in batches:
                    sock.send_multipart(envelope + [seq_bytes(s), p])
                sock.send_multipart(envelope + [END_SEQ, b""])
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=5)
        self._pub.close(0)
        self._ctx.term()
