import pytest
import torch

from pdserve.kv_connectors import block_codec
from pdserve.kv_connectors.load_errors import (CorruptBlock, FingerprintMismatch, HashMismatch, KVLoadError,
                                               TruncatedBlock)

FP, H = "f" * 32, bytes(range(32))
SHAPE = (2, 2, 4, 2, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(dtype):
    block = torch.randn(SHAPE).to(dtype)
    out = block_codec.decode_block(block_codec.encode_block(block, FP, H), FP, H, dtype, SHAPE)
    assert out.dtype == dtype and torch.equal(out, block)


def _record():
    return bytearray(block_codec.encode_block(torch.randn(SHAPE), FP, H))


@pytest.mark.parametrize("damage, error", [
    (lambda r: r[:10], TruncatedBlock),                                   # shorter than the header
    (lambda r: r[:-1], TruncatedBlock),                                   # payload cut
    (lambda r: r[:4] + b"\0\0" + r[6:], CorruptBlock),                    # unknown version
    (lambda r: b"XXXX" + r[4:], CorruptBlock),                            # bad magic
    (lambda r: r[:-5] + bytes([r[-5] ^ 1]) + r[-4:], CorruptBlock),       # one flipped payload bit
])
def test_damaged_records_raise_typed_errors(damage, error):
    with pytest.raises(error):
        block_codec.decode_block(bytes(damage(_record())), FP, H, torch.float32, SHAPE)


def test_wrong_identity_raises():
    rec = bytes(_record())
    with pytest.raises(FingerprintMismatch):
        block_codec.decode_block(rec, "e" * 32, H, torch.float32, SHAPE)
    with pytest.raises(HashMismatch):
        block_codec.decode_block(rec, FP, bytes(32), torch.float32, SHAPE)
    with pytest.raises(CorruptBlock):
        block_codec.decode_block(rec, FP, H, torch.float16, SHAPE)
    with pytest.raises(CorruptBlock):
        block_codec.decode_block(rec, FP, H, torch.float32, (2, 2, 4, 2, 4))
    assert all(issubclass(e, KVLoadError) for e in (CorruptBlock, FingerprintMismatch, HashMismatch, TruncatedBlock))


def test_crc32_records_still_verify(monkeypatch):
    """Records written where xxhash is missing (CRC-32) verify anywhere; their damage is still caught."""
    block = torch.randn(SHAPE)
    monkeypatch.setattr(block_codec, "xxhash", None)
    rec = bytearray(block_codec.encode_block(block, FP, H))
    monkeypatch.undo()
    assert block_codec.parse_header(rec).algo == block_codec.ALGO_CRC32
    assert torch.equal(block_codec.decode_block(bytes(rec), FP, H, torch.float32, SHAPE), block)
    rec[-1] ^= 1
    with pytest.raises(CorruptBlock):
        block_codec.decode_block(bytes(rec), FP, H, torch.float32, SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algo", [block_codec.ALGO_CRC32, block_codec.ALGO_XXH3, block_codec.ALGO_SUM64])
def test_block_checksums_match_per_block_and_catch_damage(dtype, algo):
    """The fused checksum of many blocks equals each block's own, is computed in place (no copy: a change to the cache
    shows), and changes with any flipped word, swapped words or a block moved to another id."""
    cache = torch.randn((40, *SHAPE)).to(dtype)
    ids = [3, 1, 7, *range(10, 30)]
    sums = block_codec.block_checksums(cache, ids, algo)
    assert sums == [block_codec.block_checksums(cache, [b], algo)[0] for b in ids]
    if algo != block_codec.ALGO_SUM64:
        assert sums == [block_codec.checksum(block_codec.tensor_bytes(cache[b]), algo) for b in ids]
    assert len(set(sums)) == len(ids)
    flat = cache[7].view(-1).view(torch.uint8)
    flat[5] ^= 0x10
    assert block_codec.block_checksums(cache, ids, algo)[2] != sums[2]
    flat[5] ^= 0x10
    words = cache[10].view(-1).view(torch.uint8).view(-1, 8)
    words[[0, 1]] = words[[1, 0]].clone()
    assert block_codec.block_checksums(cache, ids, algo)[3] != sums[3] or torch.equal(words[0], words[1])


def test_block_checksums_from_hash_threads_do_not_deadlock():
    """Chunk hashes run on the shared hash threads; one with many blocks must not wait on the same (busy) pool."""
    cache = torch.randn((64, *SHAPE))
    pool = block_codec.hash_pool()
    futs = [pool.submit(block_codec.block_checksums, cache, list(range(64)), block_codec.ALGO_XXH3) for _ in range(8)]
    assert all(f.result(timeout=60) == futs[0].result() for f in futs)
