"""A dict bounded by the bytes its entries hold (estimated), forgetting everything when full.

Used for memos on hot paths that must not grow without bound: the router's tokenized prompt pieces
(router/prompt.py) and the chained block hashes of prompts (runtime/block_hash.py), in the router and the engine.
Torch-free, like both users.
"""

from __future__ import annotations

from typing import Any, Callable


class ByteBoundedCache(dict):
    """A dict bounded by the (estimated) bytes its entries hold, that forgets everything when full (cheap; hot
    entries come right back). An entry costing more than an eighth of the bound is not kept at all: one huge
    distinct prompt must neither be held nor flush the shared pieces. ``cost(key, value)`` estimates bytes."""

    def __init__(self, capacity_bytes: int, cost: Callable[[Any, Any], int]):
        super().__init__()
        self.capacity, self.cost, self.nbytes = capacity_bytes, cost, 0

    def put(self, key, value):
        c = self.cost(key, value)
        if c > self.capacity // 8:
            return value
        if self.nbytes + c > self.capacity:
            self.clear()
            self.nbytes = 0
        if key not in self:
            self.nbytes += c
        self[key] = value
        return value
