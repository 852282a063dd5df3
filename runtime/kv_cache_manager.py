"""Per-request block tables on top of the block pool: prefix-cache lookup, allocation for new tokens, freeing.

A request's block table covers tokens ``0 .. num_tokens`` it has been allocated for; token ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. Full blocks are published to the prefix cache only once their
KV is computed (``cache_blocks`` after a step, or after a verified remote load), so a block still being written or
loaded can never be another request's hit; a failed load therefore never has a second owner.

Past its full-block hits a request may also take a cached block's leading tokens (``get_partial_hit``): its first new
block then starts with a copy of their KV, which the runner makes before the step's forward (``take_copies``, in the
scheduler's output); the source block stays referenced until the step's output comes back (``release_copy_sources``).
"""

from __future__ import annotations

from pdserve.runtime.block_pool import BlockPool, KVBlock
from pdserve.runtime.kv_events import KVEvent
from pdserve.runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks of each request already published
        self.prefix_cache_queries = 0                 # tokens looked up (cumulative)
        self.prefix_cache_hits = 0                    # tokens found (cumulative)
        self.partial_block_hits = 0                   # of them, tokens copied from a cached block's leading ones
        self._copies: list[tuple[int, int, int]] = []   # this step's (source block, destination block, slots)
        self._copy_sources: list[KVBlock] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def take_events(self) -> list[KVEvent]:
        """The pool's KV events since the last call (pdserve.runtime.block_pool)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest chain of cached full blocks that prefixes the request (never its last token, which must be
        computed to produce logits). Returns (blocks, number of tokens they hold); takes no references and counts
        nothing (see record_prefix_lookup)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.all_block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_partial_hit(self, request: Request, hits: list[KVBlock]) -> tuple[KVBlock, int] | None:
        """After the full-block ``hits`` (at least one: the first block has no index, see runtime/block_pool.py), the
        cached block whose leading tokens continue the request furthest, and how many (never reaching the request's
        last token); None without one. Takes no reference."""
        if not self.enable_caching or not hits:
            return None
        start = len(hits) * self.block_size
        end = min(start + self.block_size, request.num_tokens - 1)
        if end <= start:
            return None
        return self.pool.partial_hit(hits[-1].block_hash, request.all_token_ids[start:end])

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int, num_partial_tokens: int = 0) -> None:
        """Count one admitted request's lookup: its whole-block hits and the leading tokens it copied (lookups of
        requests that then failed to fit are not counted)."""
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens + num_partial_tokens
        self.partial_block_hits += num_partial_tokens

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The KV copies this step's allocations asked for: (source block, destination block, leading slots)."""
        copies, self._copies = self._copies, []
        return copies

    def release_copy_sources(self) -> None:
        """Drop the references that kept the step's copy sources from being reused before the copies ran."""
        self.pool.free_blocks(self._copy_sources)
        self._copy_sources = []

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] = ()) -> bool:
        return self._num_needed(request, num_new_tokens, new_computed_blocks) >= 0

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] = (),
                       partial: tuple[KVBlock, int] | None = None) -> list[KVBlock] | None:
        """Take references on ``new_computed_blocks`` (prefix hits following the request's current blocks) and allocate
        blocks so that ``num_computed_tokens + len(hits) * block_size + num_new_tokens`` tokens have slots. With a
        ``partial`` hit (:meth:`get_partial_hit`; its tokens counted in ``num_new_tokens``) the first new block gets a
        copy of that block's leading KV, and the source a reference until :meth:`release_copy_sources`. None (and no
        change) when the pool cannot supply them."""
        free_after = self._num_needed(request, num_new_tokens, new_computed_blocks)
        if partial is not None and partial[0].ref_cnt == 0:
            free_after -= 1   # a free source stops being allocatable once referenced
        if free_after < 0:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.num_cached_blocks.setdefault(request.request_id, 0)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(blocks)
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(blocks)
        if partial is not None:
            self.pool.touch([partial[0]])   # before the allocation, so that it is not evicted by it
            self._copy_sources.append(partial[0])
        first_new = len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if partial is not None:
            self._copies.append((partial[0].block_id, blocks[first_new].block_id, partial[1]))
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks whose KV is now computed (idempotent, incremental)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        hashes = request.all_block_hashes
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(hashes), len(blocks))
        bs = self.block_size
        for i in range(start, end):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(blocks[i], hashes[i], parent, request.all_token_ids[i * bs:(i + 1) * bs],
                                  request.lora_name)
        self.num_cached_blocks[request.request_id] = max(start, end)

    def invalidate_from(self, request: Request, block_index: int) -> None:
        """The request's KV from ``block_index`` on is invalid: drop those blocks' hashes so they are never hits."""
        for block in self.req_to_blocks.get(request.request_id, [])[block_index:]:
            self.pool.uncache_block(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], block_index)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its longest prefixes are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def _num_needed(self, request: Request, num_new_tokens: int, new_computed_blocks) -> int:
        """Free blocks left after the allocation (negative: it does not fit)."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(0, cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks))
        # Hits that sit free in the queue stop being allocatable once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return self.pool.get_num_free_blocks() - num_free_hits - num_new_blocks
