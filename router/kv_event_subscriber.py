"""Feeds the prefix index from one pod's KV events (ZMQ SUB), with replay (ZMQ DEALER -> the pod's ROUTER).

Wire format: ``pdserve.runtime.kv_event_publisher`` (vLLM's): live ``[topic, seq(8B BE), payload]``; replay request
``[b"", start_seq(8B BE)]``, answered by ``[b"", seq, payload]`` per retained batch then ``[b"", END_SEQ, b""]``.

Consistency rules: batches are applied in sequence order exactly once (``next_seq``). On start, replay from 0 (the
pod's retained history). A live batch beyond ``next_seq`` means batches were lost: replay the gap first. A live batch
below ``next_seq`` is a duplicate (already replayed) and is skipped. A re-established connection (the pod may have
restarted with an empty cache and a new sequence) forgets the pod's entries and replays from 0.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.router.config import KVEventSource
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix_index import PrefixIndex
from pdserve.runtime.kv_events import decode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventSubscriber:
    def __init__(self, pod: str, source: KVEventSource, index: PrefixIndex, metrics: RouterMetrics | None = None,
                 ctx: zmq.asyncio.Context | None = None, replay_timeout: float = 2.0):
        self.pod, self.source, self.index, self.metrics = pod, source, index, metrics
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.replay_timeout = replay_timeout
        self.next_seq = 0
        self.applied = 0  # batches applied (tests and debugging)

    def _apply(self, seq: int, payload: bytes, source: str) -> None:
        if seq < self.next_seq:
            return
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            log.warning("pod %s: dropping KV event batch %d: %s", self.pod, seq, e)
        else:
            self.index.apply(self.pod, batch)
            self.applied += 1
            if self.metrics is not None:
                self.metrics.kv_event_batches.labels(source).inc()
        self.next_seq = seq + 1

    async def replay(self, start: int) -> None:
        """Apply every retained batch from ``start`` on; gives up quietly after ``replay_timeout`` of silence."""
        if not self.source.replay_endpoint:
            self.next_seq = max(self.next_seq, start)
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.source.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    log.warning("pod %s: KV event replay timed out", self.pod)
                    return
                frames = [f for f in await sock.recv_multipart()]
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 2 or frames[0] == END_SEQ:
                    return
                self._apply(int.from_bytes(frames[0], "big"), frames[1], "replay")
        finally:
            sock.close(0)

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected_before = False
        try:
            await self.replay(0)
            while True:
                ready = dict(await poller.poll(1000))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        if connected_before:  # reconnect: the pod may have restarted with a fresh cache
                            log.info("pod %s: KV event stream reconnected; resyncing", self.pod)
                            self.index.forget_pod(self.pod)
                            self.next_seq = 0
                            await self.replay(0)
                        connected_before = True
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        log.warning("pod %s: malformed KV event message (%d frames)", self.pod, len(frames))
                        continue
                    seq = int.from_bytes(frames[1], "big")
                    if seq > self.next_seq:
                        await self.replay(self.next_seq)
                    self._apply(seq, frames[2], "live")
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
