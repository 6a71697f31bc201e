"""BlockPool, KVCacheManager and Scheduler on their own, without weights or a model runner.

The scheduler tests drive `Scheduler.schedule()` the way `LLMEngine.step` does: every scheduled chunk's
tokens get K/V (`num_computed += n`, then `kv.commit`), and a sequence whose chunk reached its last token
gets one new token (a fixed id standing in for the sampler, which these tests are not about).
"""
from __future__ import annotations

import pytest

from common.hashing import prefix_block_hashes
from python_backends.engine.block_pool import BlockPool
from python_backends.engine.config import EngineConfig
from python_backends.engine.kv_cache_manager import KVCacheManager
from python_backends.engine.scheduler import Scheduler
from python_backends.engine.sequence import Priority, SamplingParams, Sequence, Status

BS = 16
NEXT_TOKEN = 7


def _seq(n_prompt: int, max_tokens: int = 4, priority: int = Priority.STANDARD, first: int = 100) -> Sequence:
    return Sequence(list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), priority=priority)


# ---------------------------------------------------------------- BlockPool
def test_pool_hands_out_every_block_but_the_reserved_zero_block() -> None:
    pool = BlockPool(5)
    got = [pool.allocate() for _ in range(4)]
    assert sorted(got) == [1, 2, 3, 4] and pool.allocate() is None and pool.num_free == 0
    for b in got:
        pool.release(b)
    assert pool.num_free == pool.num_usable == 4
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_pool_keeps_freed_hashed_blocks_cached_and_evicts_them_last_and_lru_first() -> None:
    pool = BlockPool(4)                                   # usable blocks 1..3
    a, b = pool.allocate(), pool.allocate()
    assert pool.set_hash(a, 111) and pool.set_hash(b, 222)
    assert not pool.set_hash(pool.allocate(), 111)        # that prefix is already cached elsewhere
    assert pool.drain_events() == ([111, 222], []) and pool.drain_events() == ([], [])
    pool.release(a)
    pool.release(b)                                       # a freed before b: a is the LRU cached block
    assert pool.lookup(111) == a and pool.num_free == 2
    pool.acquire_cached(b)                                # revived from the free list, still indexed
    assert pool.ref_count[b] == 1 and pool.num_free == 1
    assert pool.allocate() == a                           # eviction drops a's hash ...
    assert pool.lookup(111) is None and pool.drain_events() == ([], [111])
    assert pool.cached_hashes() == [222]                  # ... and keeps b's


def test_pool_reuses_blank_blocks_before_cached_ones() -> None:
    pool = BlockPool(4)
    cached, blank = pool.allocate(), pool.allocate()
    pool.set_hash(cached, 5)
    pool.release(cached)
    pool.release(blank)
    assert pool.allocate() == blank and pool.lookup(5) == cached


# ---------------------------------------------------------------- KVCacheManager
def test_blocks_are_allocated_lazily_and_never_half() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)      # 4 usable blocks = 64 tokens
    seq = _seq(40)
    assert kv.ensure(seq, 20) and len(seq.block_table) == 2
    assert kv.ensure(seq, 32) and len(seq.block_table) == 2   # still fits: nothing new
    assert not kv.ensure(seq, 100) and len(seq.block_table) == 2 and kv.pool.num_free == 2
    kv.free(seq)
    assert seq.block_table == [] and kv.pool.num_free == 4


def test_prefix_cache_reuses_full_prompt_blocks_with_the_routers_hashes() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = _seq(40)
    kv.admit(first, kv.match_prefix(first))
    assert kv.ensure(first, 40)
    first.num_computed = 40
    kv.commit(first)
    # The engine indexes exactly the hashes the router computes for the same prompt (2 full blocks of 16).
    assert kv.pool.cached_hashes() == prefix_block_hashes(first.prompt_ids, BS)
    kv.free(first)
    again = _seq(50)                                      # same first 40 tokens, then more
    hits = kv.match_prefix(again)
    assert hits == first_blocks(kv, first.prompt_ids) and kv.can_admit(again, 8, hits)
    kv.admit(again, hits)
    assert again.num_computed == again.num_cached_prompt == 32
    assert kv.hit_rate() == pytest.approx(32 / (40 + 50))
    exact = _seq(32)                                      # a prompt of exactly two cached blocks
    assert len(kv.match_prefix(exact)) == 1               # one token is always recomputed for its logits


def first_blocks(kv: KVCacheManager, prompt: list[int]) -> list[int]:
    return [kv.pool.lookup(h) for h in prefix_block_hashes(prompt, BS)]


# ---------------------------------------------------------------- Scheduler
def _scheduler(num_kv_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8) -> Scheduler:
    config = EngineConfig(weights_dir="(none: no model in these tests)", block_size=BS, num_kv_blocks=num_kv_blocks,
                          max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, output_estimate=4)
    return Scheduler(config, KVCacheManager(num_kv_blocks, BS), acquire_lora=lambda s: True,
                     release_lora=lambda s: None)


def _step(sched: Scheduler) -> list[tuple[int, int]]:
    """One engine step without a model: returns (seq_id, tokens) as scheduled."""
    items = sched.schedule()
    for item in items:
        seq = item.seq
        seq.num_computed += item.num_tokens
        sched.kv.commit(seq)
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(NEXT_TOKEN)
            if seq.num_output >= seq.params.max_tokens:
                seq.status = Status.FINISHED
                sched.remove(seq)
    return [(i.seq.seq_id, i.num_tokens) for i in items]


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    sched = _scheduler(budget=32)
    short = _seq(8, max_tokens=50)
    sched.add(short)
    assert _step(sched) == [(short.seq_id, 8)]
    long = _seq(100, first=5000)
    sched.add(long)
    assert _step(sched) == [(short.seq_id, 1), (long.seq_id, 31)]   # the decode, then a prompt chunk
    assert _step(sched) == [(short.seq_id, 1), (long.seq_id, 31)]
    assert long.status == Status.RUNNING and long.num_computed == 62


def test_admission_order_is_priority_then_deadline_then_arrival() -> None:
    sched = _scheduler(max_num_seqs=1)
    batch, late, soon, interactive = (_seq(8, priority=Priority.BATCH), _seq(8), _seq(8), _seq(8, priority=0))
    late.deadline_ms, soon.deadline_ms = 2_000_000_000_000, 1_000_000_000_000
    for s in (batch, late, soon, interactive):
        sched.add(s)
    order = []
    while sched.has_work():
        for seq_id, _ in _step(sched):
            if seq_id not in order:
                order.append(seq_id)
    assert order == [interactive.seq_id, soon.seq_id, late.seq_id, batch.seq_id]


def test_full_pool_preempts_the_least_important_by_recompute_and_it_resumes() -> None:
    sched = _scheduler(num_kv_blocks=5, budget=64)        # 4 usable blocks
    standard, batch = _seq(20, max_tokens=20), _seq(20, max_tokens=20, priority=Priority.BATCH, first=900)
    sched.add(standard)
    sched.add(batch)                                      # both fit: 20 prompt + 4 estimated = 2 blocks each
    assert len(_step(sched)) == 2
    for _ in range(20):                                   # at 33 tokens `standard` needs a third block
        _step(sched)
        if batch.preemptions:
            break
    assert batch.preemptions == 1 and batch.status == Status.WAITING and batch.block_table == []
    assert batch.num_computed == 0 and batch.num_output > 0   # tokens kept: it re-prefills and continues
    while sched.has_work():
        _step(sched)
    assert standard.num_output == batch.num_output == 20
    assert sched.kv.pool.num_free == sched.kv.pool.num_usable   # every block came back


def test_interactive_arrival_preempts_batch_work_to_fit() -> None:
    sched = _scheduler(num_kv_blocks=5, budget=64)
    batch = _seq(40, max_tokens=20, priority=Priority.BATCH)
    sched.add(batch)
    _step(sched)
    assert batch.status == Status.RUNNING
    interactive = _seq(40, max_tokens=4, priority=Priority.INTERACTIVE, first=3000)
    sched.add(interactive)
    assert (interactive.seq_id, 40) in _step(sched)
    assert batch.preemptions == 1 and batch.status == Status.WAITING
