"""The KV pool's bookkeeping: fixed-size blocks with reference counts, a prefix-hash index and an LRU free list.

A block is in one of three states: in use (ref_count > 0), free and cached (ref 0, still indexed by its
prefix hash so a later prompt can revive it), or free and blank. The free list is ordered by eviction
preference: blank blocks first, then cached blocks least-recently-freed first, so the prefix cache keeps
the most recently used prefixes as long as memory allows. Block 0 is reserved (the zero block used as
padding by the model runner) and never handed out.

Hash additions/removals are recorded as events for the router's state report
(docs/architecture.md, State reports).
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}          # prefix hash -> block id
        self.added: list[int] = []                # hash events since the last drain
        self.removed: list[int] = []

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (blank or evictable cached)."""
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free)

    def allocate(self) -> int | None:
        """A block with ref_count 1, evicting the LRU cached block if no blank one is left."""
        if not self.free:
            return None
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                self.removed.append(h)
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None
            if self.block_hash[block] is None:
                self.free.move_to_end(block, last=False)   # blank blocks are reused first

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h)

    def acquire_cached(self, block: int) -> None:
        """Take a reference on a cached block (reviving it from the free list if idle)."""
        if self.ref_count[block] == 0:
            self.free.pop(block, None)
        self.ref_count[block] += 1

    def set_hash(self, block: int, h: int) -> bool:
        """Index a just-filled block under its chain hash; False if that prefix is already cached."""
        if h in self.cached or self.block_hash[block] is not None:
            return False
        self.block_hash[block] = h
        self.cached[h] = block
        self.added.append(h)
        return True

    def drain_events(self) -> tuple[list[int], list[int]]:
        added, removed = self.added, self.removed
        self.added, self.removed = [], []
        return added, removed

    def cached_hashes(self) -> list[int]:
        return list(self.cached)
