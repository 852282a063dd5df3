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
