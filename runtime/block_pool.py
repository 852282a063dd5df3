"""The block pool: owns every KV block id, their reference counts and the prefix-cache map ``hash -> block``.

Free blocks sit in one doubly linked queue threaded through the blocks themselves (intrusive ``prev_free``/``next_free``
pointers), so taking a free block off the head, appending a freed one at the tail, and pulling a cached block out of
the middle on a prefix hit are all O(1). The queue order is the eviction order (LRU): a block that is freed goes to the
tail; new blocks come from the head. A free block keeps its hash (and stays a prefix-cache hit) until it is reused:
only then is it evicted from the map and a ``BlockRemoved`` event emitted. Callers free a request's blocks in reverse
order so that the tail of a sequence (the longest prefix, least likely to be shared) is evicted first.

A cached block after the first of its sequence is also indexed under (its parent's hash, its first token), so a
request whose next block only begins like a cached one finds that block's leading tokens (``partial_hit``): their KV
depends only on the tokens before them, so the request may copy it rather than recompute it (SGLang's radix cache
reuses KV at token granularity the same way). The first block has no such index: its hash alone carries the cache
salt and the LoRA adapter (runtime/block_hash.py).

Invariants: ``ref_cnt == 0`` <=> the block is in the free queue; ``block_hash is not None`` <=> the block is in
``cached`` under that hash (and, with a parent, in ``children``). The pool never touches tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.runtime.block_hash import BlockHash
from pdserve.runtime.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.parent: BlockHash | None = None          # while cached: its parent's hash, and its tokens
        self.token_ids: tuple[int, ...] = ()
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self.head, self.tail = KVBlock(-1), KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free, block.prev_free, block.next_free, self.tail.prev_free = block, last, self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free, block.next_free.prev_free = block.next_free, block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is None or block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self):
        b = self.head.next_free
        while b is not None and b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.children: dict[tuple[BlockHash, int], dict[BlockHash, KVBlock]] = {}   # (parent, first token) -> blocks
        self.events: list[KVEvent] = []

    # ---- asks ----------------------------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def partial_hit(self, parent: BlockHash, token_ids: Sequence[int], max_candidates: int = 32
                    ) -> tuple[KVBlock, int] | None:
        """The cached block after ``parent`` that shares the longest run of leading tokens with ``token_ids`` (at
        least one, at most ``len(token_ids)``), and that run's length; None without one. Looks at most
        ``max_candidates`` blocks, so a prefix followed by many cached continuations costs a bounded lookup."""
        if not self.enable_caching or not token_ids:
            return None
        best: tuple[KVBlock, int] | None = None
        for i, block in enumerate(self.children.get((parent, token_ids[0]), {}).values()):
            if i == max_candidates:
                break
            n = next((j for j, (a, b) in enumerate(zip(block.token_ids, token_ids)) if a != b),
                     min(len(block.token_ids), len(token_ids)))
            if best is None or n > best[1]:
                best = (block, n)
        return best

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free: they are evictable)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    # ---- acts ----------------------------------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks off the head of the free queue, evicting their cached hashes. Raises if fewer are free."""
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue tail in the given (eviction) order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, parent: BlockHash | None,
                    token_ids: Sequence[int], lora_name: str | None = None) -> bool:
        """Publish a full, computed block under its hash. False when another block already holds that hash (the
        block then stays private and is simply freed later)."""
        if not self.enable_caching or block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if parent is not None and token_ids:
            block.parent, block.token_ids = parent, tuple(token_ids)
            self.children.setdefault((parent, block.token_ids[0]), {})[block_hash] = block
        self.events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_name))
        return True

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash now (its KV is invalid: it must never be a prefix hit)."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only allowed when no block is in use (returns False otherwise)."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.parent, block.token_ids = None, None, ()
        self.cached.clear()
        self.children.clear()
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            if block.parent is not None:
                key = (block.parent, block.token_ids[0])
                siblings = self.children.get(key, {})
                if siblings.get(block.block_hash) is block:
                    del siblings[block.block_hash]
                    if not siblings:
                        del self.children[key]
                block.parent, block.token_ids = None, ()
            self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
