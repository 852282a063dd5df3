"""One KV block as bytes: a fixed binary header followed by the block's raw tensor bytes. No pickle.

The block-major cache makes block ``b`` one contiguous slice ``kv_cache[b]`` of shape
(num_layers, 2, block_size, num_kv_heads, head_dim), so a block is stored as exactly those bytes. Header (little endian):

    magic "PDKV" | version u16 | ndim u16 | fingerprint 32s | block hash 32s | dtype 16s | shape 8*u32 |
    payload length u64 | crc32 u32

The checksum is zlib's CRC-32 (stdlib, ~4 GB/s here) over the payload. :func:`decode_block` checks everything
(length, magic, version, fingerprint, block hash, dtype, shape, checksum) and raises a typed
:class:`~pdserve.kv_connectors.load_errors.KVLoadError`; a store raises ``MissingBlock`` for an absent key.
"""

from __future__ import annotations

import struct
import warnings
import zlib

import torch

from pdserve.kv_connectors.load_errors import CorruptBlock, FingerprintMismatch, HashMismatch, TruncatedBlock

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHH32s32s16s8IQI")
HEADER_SIZE = _HEADER.size


def tensor_bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (a live view: snapshot first if it may change)."""
    assert block.device.type == "cpu" and block.is_contiguous(), "pass a contiguous CPU tensor"
    return memoryview(block.reshape(-1).view(torch.uint8).numpy())


def checksum(payload: memoryview | bytes) -> int:
    return zlib.crc32(payload)


def encode_header(block: torch.Tensor, fingerprint: str, block_hash: bytes, payload: memoryview | bytes,
                  crc: int | None = None) -> bytes:
    shape = list(block.shape) + [0] * (8 - block.dim())
    return _HEADER.pack(MAGIC, VERSION, block.dim(), fingerprint.encode(), block_hash,
                        str(block.dtype).removeprefix("torch.").encode(), *shape, len(payload),
                        checksum(payload) if crc is None else crc)


def encode_block(block: torch.Tensor, fingerprint: str, block_hash: bytes) -> bytes:
    """Header + payload as one bytes object (``block``: contiguous CPU tensor)."""
    payload = tensor_bytes(block)
    return encode_header(block, fingerprint, block_hash, payload) + payload


def decode_block(data: bytes | memoryview, fingerprint: str, block_hash: bytes, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """Verify ``data`` and return the block as a tensor viewing ``data`` (no copy).

    Raises TruncatedBlock, CorruptBlock, FingerprintMismatch or HashMismatch (all KVLoadError).
    """
    if len(data) < HEADER_SIZE:
        raise TruncatedBlock(f"{len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, ndim, fp, bh, dt, *rest = _HEADER.unpack_from(data)
    dims, length, crc = rest[:8], rest[8], rest[9]
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"bad magic/version {magic!r}/{version}")
    if fp.decode(errors="replace") != fingerprint:
        raise FingerprintMismatch(f"block fingerprint {fp.decode(errors='replace')} != ours {fingerprint}")
    if bh != block_hash:
        raise HashMismatch(f"block is {bh.hex()[:16]}, expected {block_hash.hex()[:16]}")
    want_dt = str(dtype).removeprefix("torch.")
    if dt.rstrip(b"\0").decode(errors="replace") != want_dt or tuple(dims[:ndim]) != tuple(shape):
        raise CorruptBlock(f"block is {dt!r}{dims[:ndim]}, expected {want_dt}{tuple(shape)}")
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise TruncatedBlock(f"payload is {len(payload)} bytes, header says {length}")
    if checksum(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    with warnings.catch_warnings():  # read-only buffers (file/Redis bytes) are fine: decoded blocks are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)
