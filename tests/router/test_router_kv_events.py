"""The router's KV event subscriber against the runtime's real ZMQ publisher on loopback: live batches, replay of
history on start, gap repair, and a resync when the pod restarts with a fresh cache."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.config import KVEventSource
from pdserve.router.kv_event_subscriber import KVEventSubscriber
from pdserve.router.prefix_index import PrefixIndex
from pdserve.runtime.block_hash import hash_token_blocks
from pdserve.runtime.kv_event_publisher import KVEventPublisher
from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.server import free_port

TOKENS = list(range(80))
H = hash_token_blocks(TOKENS, 16)  # 5 blocks


async def until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def stored(i: int) -> BlockStored:
    return BlockStored([H[i]], H[i - 1] if i else None, TOKENS[16 * i:16 * (i + 1)], 16)


@pytest.fixture
def ports():
    return free_port(), free_port()


async def test_history_replay_live_events_and_pod_restart(ports):
    port, rport = ports
    pub = KVEventPublisher("127.0.0.1", port, replay_port=rport)
    pub.publish([stored(0)])
    pub.publish([stored(1)])             # published before the router subscribed: only replay can deliver these
    idx = PrefixIndex()
    sub = KVEventSubscriber("pod", KVEventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"), idx)
    task = asyncio.create_task(sub.run())
    try:
        await until(lambda: idx.match(H, ["pod"])["pod"] == 2)
        # live: more blocks, then a removal (publish until the SUB is connected: PUB drops before that)
        for i in (2, 3):
            pub.publish([stored(i)])
        await until(lambda: idx.match(H, ["pod"])["pod"] == 4)
        pub.publish([BlockRemoved([H[1]])])
        await until(lambda: idx.match(H, ["pod"])["pod"] == 1)
        pub.publish([AllBlocksCleared()])
        await until(lambda: idx.match(H, ["pod"])["pod"] == 0)
        assert sub.next_seq == pub.next_seq

        # the pod restarts: new publisher on the same ports, fresh sequence, fresh cache
        pub.close()
        idx.store("pod", H[:3])  # stale knowledge that must be dropped on reconnect
        pub = KVEventPublisher("127.0.0.1", port, replay_port=rport)
        pub.publish([stored(0)])
        await until(lambda: sub.next_seq == 1 and idx.match(H, ["pod"])["pod"] == 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()


async def test_gap_in_live_sequence_is_replayed(ports):
    port, rport = ports
    pub = KVEventPublisher("127.0.0.1", port, replay_port=rport)
    idx = PrefixIndex()
    sub = KVEventSubscriber("pod", KVEventSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"), idx)
    task = asyncio.create_task(sub.run())
    try:
        await asyncio.sleep(0.3)
        pub.publish([stored(0)])
        await until(lambda: sub.next_seq == 1)
        # simulate lost live messages: batches 1..2 go only into the replay buffer
        with pub._lock:
            for i in (1, 2):
                from pdserve.runtime.kv_events import KVEventBatch, encode_batch
                pub._buffer.append((pub._next_seq, encode_batch(KVEventBatch([stored(i)]))))
                pub._next_seq += 1
        pub.publish([stored(3)])  # seq 3 arrives live: the subscriber notices 1..2 are missing
        await until(lambda: idx.match(H, ["pod"])["pod"] == 4)
        assert sub.applied == 4
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
