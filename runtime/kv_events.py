"""KV-cache events, the feed that lets a router know which blocks each pod holds (torch-free; the router imports it).

Shapes follow vLLM's events so existing consumers can read them: a batch is ``[timestamp, [event, ...]]`` and each
event is a tagged list, msgpack-encoded (never pickle):

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_name, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are the 32-byte digests of pdserve.runtime.block_hash (msgpack bin). On the wire (ZMQ PUB) each batch is a
multipart message ``[topic, seq (8-byte big-endian), payload]``; a replay socket answers a start sequence number with
every retained batch from it on (see pdserve.runtime.kv_event_publisher).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgpack


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    events: list[KVEvent]
    ts: float = field(default_factory=time.time)


def encode_batch(batch: KVEventBatch) -> bytes:
    def one(e: KVEvent) -> list:
        if isinstance(e, BlockStored):
            return ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_name, e.medium]
        if isinstance(e, BlockRemoved):
            return ["BlockRemoved", e.block_hashes, e.medium]
        return ["AllBlocksCleared"]

    return msgpack.packb([batch.ts, [one(e) for e in batch.events]], use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of encode_batch; raises ValueError on anything malformed (the payload comes from the network)."""
    try:
        ts, raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        events: list[KVEvent] = []
        for item in raw:
            tag, args = item[0], item[1:]
            if tag == "BlockStored":
                h, parent, tokens, bs, lora, medium = args
                events.append(BlockStored([bytes(x) for x in h], None if parent is None else bytes(parent),
                                          [int(t) for t in tokens], int(bs), lora, medium))
            elif tag == "BlockRemoved":
                h, medium = args
                events.append(BlockRemoved([bytes(x) for x in h], medium))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown KV event {tag!r}")
        return KVEventBatch(events, float(ts))
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed KV event batch: {e}") from e
