"""Block pool and prefix cache scenarios with hand-computed block ids, hit counts and eviction order (CPU only)."""

from __future__ import annotations

import pytest

from pdserve.runtime.block_hash import hash_token_blocks
from pdserve.runtime.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pdserve.runtime.kv_cache_manager import KVCacheManager
from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.runtime.request import Request
from pdserve.runtime.sampling_params import SamplingParams

BS = 4


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), block_size=BS, cache_salt=salt)


def test_free_queue_is_intrusive_and_ordered():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])                       # O(1) from the middle
    assert [b.block_id for b in q] == [0, 1, 3] and q.num_free == 3
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q] == [1, 3, 2]
    with pytest.raises(AssertionError):
        q.remove(blocks[0])                   # not free any more


def test_allocate_free_reverse_order():
    pool = BlockPool(5, BS)
    a = pool.get_new_blocks(2)
    assert ids(a) == [0, 1] and pool.get_num_free_blocks() == 3
    pool.free_blocks(reversed(a))
    assert [b.block_id for b in pool.free_queue] == [2, 3, 4, 1, 0]
    assert ids(pool.get_new_blocks(4)) == [2, 3, 4, 1]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)


def test_cached_block_survives_free_until_reused_then_evicted():
    pool = BlockPool(4, BS)
    h = hash_token_blocks(list(range(8)), BS)
    a = pool.get_new_blocks(2)
    assert pool.cache_block(a[0], h[0], None, [0, 1, 2, 3])
    assert pool.cache_block(a[1], h[1], h[0], [4, 5, 6, 7])
    assert pool.take_events() == [BlockStored([h[0]], None, [0, 1, 2, 3], BS),
                                  BlockStored([h[1]], h[0], [4, 5, 6, 7], BS)]
    pool.free_blocks(reversed(a))             # queue: 2, 3, 1, 0
    assert pool.get_cached_block(h[0]) is a[0] and pool.usage() == 0.0
    pool.touch([a[0]])                        # a prefix hit pulls block 0 out of the middle of the queue
    assert a[0].ref_cnt == 1 and [b.block_id for b in pool.free_queue] == [2, 3, 1]
    assert ids(pool.get_new_blocks(2)) == [2, 3] and pool.take_events() == []
    assert ids(pool.get_new_blocks(1)) == [1]  # reusing block 1 evicts its hash
    assert pool.take_events() == [BlockRemoved([h[1]])]
    assert pool.get_cached_block(h[1]) is None and pool.get_cached_block(h[0]) is a[0]


def test_duplicate_hash_stays_private_and_reset():
    pool = BlockPool(3, BS)
    h = hash_token_blocks([1, 2, 3, 4], BS)[0]
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h, None, [1, 2, 3, 4])
    assert not pool.cache_block(b, h, None, [1, 2, 3, 4]) and b.block_hash is None
    assert not pool.reset_prefix_cache()      # blocks in use
    pool.free_blocks([a, b])
    pool.take_events()
    assert pool.reset_prefix_cache() and pool.get_cached_block(h) is None
    assert pool.take_events() == [AllBlocksCleared()]


def test_prefix_cache_hits_never_the_last_token_and_salted():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(1, 11)))                       # 10 tokens: 2 full blocks + 2
    assert kv.get_computed_blocks(a) == ([], 0)
    assert ids(kv.allocate_slots(a, 10)) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_blocks(a, 10)                                  # blocks 0, 1 published; 2 is partial
    assert [e.block_hashes for e in kv.pool.take_events()] == [[a.all_block_hashes[0]], [a.all_block_hashes[1]]]

    b = req("b", list(range(1, 9)) + [99])                  # shares 2 full blocks
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1] and n == 8
    assert ids(kv.allocate_slots(b, 1, hits)) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]

    c = req("c", list(range(1, 9)))                         # exactly 2 blocks: the last token must be computed
    assert ids(kv.get_computed_blocks(c)[0]) == [0]
    d = req("d", list(range(1, 11)), salt="tenant-x")       # a salt isolates the cache
    assert kv.get_computed_blocks(d) == ([], 0)


def test_free_evicts_longest_prefix_first():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(12)) + [50])                    # 3 full blocks + 1 token -> blocks 0..3
    kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.cache_blocks(a, 13)
    kv.free(a)                                             # queue: 4, 5, then a's blocks tail first: 3, 2, 1, 0
    assert [b.block_id for b in kv.pool.free_queue] == [4, 5, 3, 2, 1, 0]
    kv.pool.take_events()
    kv.pool.get_new_blocks(4)                              # 4, 5, 3 (uncached), 2 (a's third block)
    assert kv.pool.take_events() == [BlockRemoved([a.all_block_hashes[2]])]
    b = req("b", list(range(12)) + [60])
    hits, n = kv.get_computed_blocks(b)                    # the first two blocks survived
    assert ids(hits) == [0, 1] and n == 8


def test_allocation_counts_free_hits_and_fails_cleanly():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_blocks(a, 9)
    kv.free(a)                                             # all 3 free, blocks 0 and 1 cached
    b = req("b", list(range(8)) + [7, 7, 7, 7, 7])         # 13 tokens: 2 hits + 2 new blocks = 4 > 3
    hits, _ = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.pool.get_num_free_blocks() == 3 and all(x.ref_cnt == 0 for x in kv.pool.blocks)
    c = req("c", list(range(8)) + [1, 2])                  # 10 tokens: 2 hits + 1 new block
    assert ids(kv.allocate_slots(c, 2, kv.get_computed_blocks(c)[0])) == [0, 1, 2]


def test_invalidate_drops_hashes():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(13)))
    kv.allocate_slots(a, 13)
    kv.cache_blocks(a, 12)
    kv.invalidate_from(a, 1)
    assert kv.pool.get_cached_block(a.all_block_hashes[0]) is not None
    assert all(kv.pool.get_cached_block(h) is None for h in a.all_block_hashes[1:])


def _cached(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request whose every full block is computed and published, then freed (its blocks stay cached)."""
    r = req(rid, tokens)
    kv.allocate_slots(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    kv.cache_blocks(r, len(tokens))
    kv.free(r)
    return r


def test_partial_hit_takes_a_cached_blocks_leading_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    _cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])           # blocks 0 [1-4], 1 [5-8] cached, 2 holds [9]
    b = req("b", [1, 2, 3, 4, 5, 6, 30, 31, 32])             # block 1 begins like a's: 5, 6
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == [0] and n == 4
    src, k = kv.get_partial_hit(b, hits)
    assert src.block_id == 1 and k == 2
    blocks = kv.allocate_slots(b, 5, hits, (src, k))          # slots for tokens 4..8: the 2 copied, 3 computed
    assert ids(blocks)[0] == 0 and len(blocks) == 3 and 1 not in ids(blocks)
    assert kv.take_copies() == [(1, blocks[1].block_id, 2)] and kv.take_copies() == []
    assert src.ref_cnt == 1                                   # kept from reuse until the copy has run
    kv.release_copy_sources()
    assert src.ref_cnt == 0 and kv.pool.get_cached_block(src.block_hash) is src

    c = req("c", [1, 2, 3, 4, 5, 6, 7, 8])                   # 2 full blocks, but its last token must be computed:
    hits = kv.get_computed_blocks(c)[0]                      # block 1 is not a hit, its first 3 tokens are
    assert ids(hits) == [0] and kv.get_partial_hit(c, hits)[1] == 3
    assert kv.get_partial_hit(req("d", [1, 2, 3, 4, 99, 5]), hits) is None   # no cached block begins with 99
    assert kv.get_partial_hit(req("e", [1, 2, 9]), []) is None               # the first block: never (salt, LoRA)


def test_partial_hit_index_follows_eviction_and_reset():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits = kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 0, 0]))[0]
    assert kv.get_partial_hit(req("b", [1, 2, 3, 4, 5, 0, 0]), hits)[1] == 1
    kv.pool.get_new_blocks(3)                                # 3, then a's blocks 2 and 1: block 1 evicted
    assert kv.get_partial_hit(req("b", [1, 2, 3, 4, 5, 0, 0]), hits) is None
    assert kv.pool.children == {}
    kv2 = KVCacheManager(num_blocks=4, block_size=BS)
    _cached(kv2, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv2.pool.children and kv2.reset_prefix_cache() and kv2.pool.children == {}


def test_partial_hit_allocation_fails_cleanly_and_counts_a_free_source():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    _cached(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])             # all 3 free; 0 and 1 cached
    b = req("b", [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0])          # 1 hit, 2 copied, 9 slots past the hit: 3 new blocks
    hits = kv.get_computed_blocks(b)[0]
    partial = kv.get_partial_hit(b, hits)
    assert partial[1] == 2
    assert kv.allocate_slots(b, 7, hits, partial) is None     # 1 hit + source + 2 new > 3 blocks
    assert kv.take_copies() == [] and all(x.ref_cnt == 0 for x in kv.pool.blocks)


def test_partial_hit_looks_at_a_bounded_number_of_candidates():
    pool = BlockPool(40, BS)
    parent = hash_token_blocks([1, 2, 3, 4], BS)[0]
    for i in range(35):                                       # 35 cached continuations all starting with 5
        pool.cache_block(pool.blocks[i], bytes([i]) * 32, parent, [5, i, i, i])
    block, n = pool.partial_hit(parent, [5, 3, 3, 3])
    assert (block.block_id, n) == (3, 4)
    assert pool.partial_hit(parent, [5, 34, 34, 34])[1] == 1  # past max_candidates (32): only the first token
    assert pool.partial_hit(parent, [5, 34, 34, 34], max_candidates=40)[1] == 4
