"""What a usage loader does when Kafka moves partitions between the workers of its group, so that the
de-duplication window (usage/dedup.py) still holds across owners.

The gap it closes: worker A writes a batch to the lake and dies (or loses the partition) before committing
its offsets; worker B, whose window was seeded from the lake before A's write, is given A's partitions,
re-reads that batch and would store it again.

The rule: every write of the previous owner is in the lake before the new owner looks, and the new owner
looks again when it gets partitions.
- Revoked (a live rebalance): the owner waits for its in-flight write to land before it rejoins the group
  (the group cannot assign the partitions elsewhere until it has rejoined), drops the pending offset commit
  of the revoked partitions (it no longer owns them) and drops the records of revoked partitions it had
  polled but not yet written (their new owner reads them again).
- Lost (the owner died or was expelled): its writes happened before its death, which is before the session
  timeout that moved the partitions.
- Assigned: the next batch starts with a re-seed of the window from the lake (usage/recovery.py), which now
  holds every batch the previous owner wrote, whoever wrote it. This reads the window's ids (~3 M at the
  requirements' peak, a few seconds) once per rebalance.

Not covered: an owner that stalls longer than the session timeout *inside* a lake commit and commits after
the new owner re-seeded (a zombie writer). Kafka's own answer is transactional offsets; the window's
re-seed on every later rebalance and the daily chargeback over distinct request ids bound the harm.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from kafka import ConsumerRebalanceListener
from kafka.structs import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

WRITE_WAIT_S = 60.0  # longest a revoke waits for the in-flight write (a lake commit takes well under that)


class InFlight:
    """The batch being written on the writer thread and the offsets to commit once it is in the lake."""

    def __init__(self, future: Future, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.future, self.offsets = future, offsets


class Rebalance(ConsumerRebalanceListener):
    """The loader's rebalance listener (called inside the consumer's poll, on the polling thread)."""

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self.inflight: InFlight | None = None
        self.reseed = threading.Event()  # set on assignment; the next batch re-seeds the window first
        self.generation = 0  # counts rebalances, so a poll loop knows its earlier records may be stale

    def on_partitions_revoked(self, revoked) -> None:
        self._give_up(revoked, "revoked")

    def on_partitions_lost(self, lost) -> None:
        self._give_up(lost, "lost")

    def on_partitions_assigned(self, assigned) -> None:
        log.info("usage loader %s: partitions assigned %s", self.writer,
                 sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))
        self.generation += 1
        self.reseed.set()

    def _give_up(self, partitions, how: str) -> None:
        self.generation += 1
        flight = self.inflight
        if flight is None or not partitions:
            return
        try:
            # Blocks this consumer's heartbeats for at most one write: the group waits for our rejoin anyway.
            flight.future.exception(timeout=WRITE_WAIT_S)
        except FutureTimeout:
            log.error("usage loader %s: write still running %.0f s after partitions were %s", self.writer,
                      WRITE_WAIT_S, how)
        flight.offsets = {tp: o for tp, o in flight.offsets.items() if tp not in set(partitions)}
        log.info("usage loader %s: partitions %s %s after the in-flight write landed", self.writer,
                 sorted(f"{tp.topic}/{tp.partition}" for tp in partitions), how)

    @staticmethod
    def keep_assigned(consumer, records: list) -> list:
        """The records of partitions this consumer still owns (after a rebalance inside a poll loop)."""
        owned = consumer.assignment()
        return [r for r in records if TopicPartition(r.topic, r.partition) in owned]
