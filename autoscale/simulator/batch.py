"""Batch-tier bookkeeping for the fluid simulation: deadline buckets per unit, EDF fill, overflow.

Batch work is kept as (deadline, replica-seconds) buckets per unit, earliest deadline first. Each step it
is admitted into spare capacity; a bucket past its deadline is counted as missed (and still served);
what a unit cannot fit may run in the spare capacity of the same pool in the other region (overflow:
the router sends the batch request there; its result returns over the network, no KV moves).
"""
from __future__ import annotations

import math

BATCH_URGENT_S = 4 * 3600.0
MERGE_S = 900.0  # submissions within 15 min share a bucket


class BatchQueue:
    """One unit's pending batch work, in replica-seconds of that unit."""

    def __init__(self) -> None:
        self.buckets: list[list[float]] = []
        self.missed_work = 0.0

    def submit(self, deadline_s: float, work: float) -> None:
        if work <= 0:
            return
        if self.buckets and self.buckets[-1][0] > deadline_s - MERGE_S:
            self.buckets[-1][1] += work
        else:
            self.buckets.append([deadline_s, work])

    def take(self, budget: float) -> float:
        """Admit up to `budget` replica-seconds, earliest deadline first; returns what was taken."""
        taken = 0.0
        while self.buckets and budget - taken > 1e-9:
            part = min(budget - taken, self.buckets[0][1])
            self.buckets[0][1] -= part
            taken += part
            if self.buckets[0][1] <= 1e-9:
                self.buckets.pop(0)
        return taken

    def expire(self, now_s: float) -> None:
        """Buckets past their deadline: count their remaining work as missed, keep serving it."""
        for bucket in self.buckets:
            if bucket[0] >= now_s:
                break
            self.missed_work += bucket[1]
            bucket[0] = math.inf

    @property
    def waiting(self) -> bool:
        return bool(self.buckets)

    @property
    def pending_work(self) -> float:
        return sum(r for _, r in self.buckets)

    def due_within(self, now_s: float, horizon_s: float) -> float:
        return sum(r for d, r in self.buckets if d - now_s <= horizon_s)

    def required_rate(self, now_s: float) -> float:
        """Replica-s/s the backlog needs so every bucket due within BATCH_URGENT_S meets its deadline
        (EDF feasibility). Work due later is left to spare capacity (nights), so batch never adds to the peak."""
        need, cum = 0.0, 0.0
        for deadline, remaining in self.buckets:
            cum += remaining
            if deadline - now_s <= BATCH_URGENT_S:
                need = max(need, cum / max(deadline - now_s, 60.0))
        return need
