"""Chained block hashes: the memo in ``hash_token_blocks`` returns the direct chain's hashes and does its work."""

from __future__ import annotations

import random

import pytest

from pdserve.runtime import block_hash
from pdserve.runtime.block_hash import block_extra_keys, hash_block, hash_token_blocks
from pdserve.runtime.byte_bounded_cache import ByteBoundedCache


def direct_chain(ids, block_size, salt=None, parent=None, start_block=0, lora=None):
    out = []
    for i in range(len(ids) // block_size):
        parent = hash_block(parent, ids[i * block_size:(i + 1) * block_size],
                            block_extra_keys(start_block + i, salt, lora))
        out.append(parent)
    return out


@pytest.fixture
def counted(monkeypatch):
    """A fresh memo, and a count of the blocks really hashed."""
    monkeypatch.setattr(block_hash, "_MEMO", ByteBoundedCache(block_hash.MEMO_BYTES, block_hash._block_cost))
    calls = []
    real = block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda *a: calls.append(a) or real(*a))
    return calls


def test_memoized_chain_equals_the_direct_chain(counted):
    rng = random.Random(0)
    ids = [rng.randrange(50_000) for _ in range(200)]
    for salt, lora in ((None, None), ("tenant-a", None), (None, "digest-1"), ("tenant-a", "digest-1")):
        for _ in range(2):   # computed, then from the memo
            assert hash_token_blocks(ids, 16, salt, lora_digest=lora) == direct_chain(ids, 16, salt, lora=lora)
    # a continued chain (a growing sequence) and a prefix of another prompt
    head = hash_token_blocks(ids[:64], 16)
    assert hash_token_blocks(ids[64:160], 16, parent=head[-1], start_block=4) == direct_chain(ids, 16)[4:10]
    assert hash_token_blocks(ids[:100], 16) == direct_chain(ids, 16)[:6]
    # salts and adapters never share a chain, even from the memo
    firsts = {hash_token_blocks(ids, 16, s, lora_digest=d)[0] for s in (None, "a", "b") for d in (None, "x")}
    assert len(firsts) == 6


def test_a_shared_prefix_is_hashed_once(counted):
    rng = random.Random(1)
    prefix = [rng.randrange(50_000) for _ in range(1000)]   # 62 full blocks and 8 tokens of a 63rd
    for i in range(5):
        ids = prefix + [rng.randrange(50_000) for _ in range(24)]
        assert hash_token_blocks(ids, 16) == direct_chain(ids, 16)
        # the first request hashes all 64 blocks; later ones only the 2 that hold their own tokens
        assert len(counted) == 64 + 2 * i
    assert hash_token_blocks(prefix, 16, "other-tenant")
    assert len(counted) == 64 + 2 * 4 + 62


def test_memo_stays_within_its_bytes(monkeypatch):
    memo = ByteBoundedCache(64 * 1024, block_hash._block_cost)
    monkeypatch.setattr(block_hash, "_MEMO", memo)
    rng = random.Random(2)
    for _ in range(100):   # distinct prompts of 32 blocks each: ~30 KB of entries a prompt
        ids = [rng.randrange(50_000) for _ in range(512)]
        assert hash_token_blocks(ids, 16) == direct_chain(ids, 16)
        assert 0 < memo.nbytes <= memo.capacity
        assert memo.nbytes == sum(block_hash._block_cost(k, v) for k, v in memo.items())
