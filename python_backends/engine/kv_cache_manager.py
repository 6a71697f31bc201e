"""Per-sequence KV block tables on top of the BlockPool, with prefix caching.

Blocks are allocated lazily, as a sequence's tokens are scheduled (never max length up front). A sequence's
full blocks - prompt and generated tokens alike, so a chat follow-up that resends the history hits the cache -
are hashed with the shared chain hash (common.hashing) rooted at the sequence's LoRA adapter, so the engine and
the routers agree on what a cached prefix is and adapter K/V never serve the base model. On admission the
longest cached prefix is reused (reference counted); at least one token is always recomputed so the step has
logits to sample the next token from.
"""
from __future__ import annotations

from common.hashing import extend_block_hashes
from python_backends.engine.block_pool import BlockPool
from python_backends.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.prefix_queried_tokens = 0    # prompt tokens looked up at first admission
        self.prefix_hit_tokens = 0        # of which served from cache

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _hashes(self, seq: Sequence, upto_blocks: int) -> list[int]:
        """Chain hashes of the sequence's first `upto_blocks` full blocks (extended incrementally: tokens only
        ever get appended, preemption keeps them)."""
        if self.enable_prefix_cache and len(seq.block_hashes) < upto_blocks:
            extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.lora_name, upto_blocks)
        return seq.block_hashes[:upto_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest cached prefix of the tokens, leaving >= 1 token to compute."""
        blocks: list[int] = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_admit(self, seq: Sequence, reserve_tokens: int, hits: list[int]) -> bool:
        """Would the prompt plus `reserve_tokens` of output fit in the free blocks (cached hits are free)?"""
        need = self.blocks_for(seq.num_tokens + reserve_tokens) - len(hits)
        idle_hits = sum(1 for b in hits if self.pool.ref_count[b] == 0)   # these sit in the free list
        return need <= self.pool.num_free - idle_hits

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        for block in hits:
            self.pool.acquire_cached(block)
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        if not seq.counted_cache:
            seq.counted_cache = True
            seq.num_cached_prompt = seq.num_computed
            self.prefix_queried_tokens += seq.num_prompt
            self.prefix_hit_tokens += seq.num_computed

    def ensure(self, seq: Sequence, tokens: int) -> bool:
        """Grow the block table to hold `tokens` tokens; False (nothing half-done kept) if the pool is empty."""
        need = self.blocks_for(tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self.pool.allocate())
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step: index the blocks (prompt or generated) that are now full and computed."""
        if not self.enable_prefix_cache:
            return
        # min: with async decode a step's K/V may be computed before its input token reaches token_ids
        upto = min(seq.num_computed, seq.num_tokens) // self.block_size
        if upto <= seq.num_hashed_blocks:
            return
        hashes = self._hashes(seq, upto)
        for i in range(seq.num_hashed_blocks, upto):
            self.pool.set_hash(seq.block_table[i], hashes[i])
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, upto)

    def free(self, seq: Sequence) -> None:
        # Tail first: the free list evicts in order, so a prefix's last blocks go before its first ones.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0

    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
