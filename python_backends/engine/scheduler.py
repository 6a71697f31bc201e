"""Continuous batching with chunked prefill, priority admission and preemption by recompute.

Each iteration (`schedule`):
1. every running sequence that is decoding gets one token (its KV slot is allocated now; when the pool is
   empty the lowest-priority running sequence is preempted - its blocks freed, itself sent back to the
   waiting queue to be recomputed later);
2. running sequences still in prefill get their next prompt chunk;
3. waiting sequences are admitted in (priority, deadline, arrival) order while the per-step token budget,
   the sequence cap and the KV pool allow: a sequence is admitted only if its prompt plus an output
   estimate fits in the free blocks. An interactive sequence that does not fit may preempt batch work.
Decodes come first in the step's batch (the model runner's layout); a long prompt is cut into chunks so it
never stalls running streams for its whole prefill.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from python_backends.engine.config import EngineConfig
from python_backends.engine.kv_cache_manager import KVCacheManager
from python_backends.engine.sequence import Priority, Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.seq.num_computed > 0


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 acquire_lora: Callable[[Sequence], bool], release_lora: Callable[[Sequence], None]):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.acquire_lora = acquire_lora
        self.release_lora = release_lora
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=Sequence.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished/aborted sequence out of the queues and free its blocks and adapter pin."""
        if seq in self.running:
            self.running.remove(seq)
            self.release_lora(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ preemption
    def _victim(self, exclude: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if s.seq_id not in exclude]
        return max(candidates, key=Sequence.sort_key) if candidates else None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue."""
        self.running.remove(seq)
        self.release_lora(seq)
        self.kv.free(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # ------------------------------------------------------------------ one iteration
    def schedule(self) -> list[Scheduled]:
        budget = self.config.max_num_batched_tokens
        decodes: list[Scheduled] = []
        chunks: list[Scheduled] = []
        scheduled_ids: set[int] = set()
        if self.waiting and self.waiting[0].priority == Priority.INTERACTIVE:
            self._make_room(self.waiting[0])
        # 1. decodes, highest priority first so preemption hits the least important
        for seq in sorted(self.running, key=Sequence.sort_key):
            if seq.status != Status.RUNNING or seq.in_prefill:
                continue
            while not self.kv.ensure(seq, seq.num_tokens):
                victim = self._victim(exclude=scheduled_ids)
                if victim is None or victim is seq:
                    self._preempt(seq)
                    break
                self._preempt(victim)
            else:
                decodes.append(Scheduled(seq, 1))
                scheduled_ids.add(seq.seq_id)
                budget -= 1
        # 2. unfinished prefills of running sequences
        for seq in sorted(self.running, key=Sequence.sort_key):
            if budget <= 0:
                break
            if seq.seq_id in scheduled_ids or not seq.in_prefill:
                continue
            item = self._chunk(seq, budget)
            if item is None:
                continue
            chunks.append(item)
            scheduled_ids.add(seq.seq_id)
            budget -= item.num_tokens
        # 3. admissions
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq)
            reserve = self._reserve(seq)
            if not self.kv.can_admit(seq, reserve, hits) and (self.running or not self.kv.can_admit(seq, 0, hits)):
                break        # (an idle engine admits a prompt that fits even if its output estimate does not)
            if not self.acquire_lora(seq):
                break        # every adapter slot is pinned by running work: wait for one to finish
            self.waiting.pop(0)
            self.kv.admit(seq, hits)
            seq.status = Status.RUNNING
            self.running.append(seq)
            item = self._chunk(seq, budget)
            if item is not None:
                chunks.append(item)
                scheduled_ids.add(seq.seq_id)
                budget -= item.num_tokens
        if not decodes and not chunks and self.running:
            # Every running sequence is stuck mid-prefill on an empty pool: free the least important one.
            self._preempt(max(self.running, key=Sequence.sort_key))
            if self.running:
                return self.schedule()
        return decodes + chunks

    def _chunk(self, seq: Sequence, budget: int) -> Scheduled | None:
        n = min(seq.num_tokens - seq.num_computed, budget)
        if n <= 0 or not self.kv.ensure(seq, seq.num_computed + n):
            return None
        return Scheduled(seq, n)

    def _reserve(self, seq: Sequence) -> int:
        return max(0, min(self.config.output_estimate, seq.params.max_tokens - seq.num_output))

    def _make_room(self, seq: Sequence) -> None:
        """Interactive work that does not fit may preempt batch-tier sequences (least important first)."""
        while not self.kv.can_admit(seq, self._reserve(seq), self.kv.match_prefix(seq)):
            batch = [s for s in self.running if s.priority == Priority.BATCH]
            if not batch:
                return
            self._preempt(max(batch, key=Sequence.sort_key))
