"""Admission queue per model version: priority, then deadline, then the team's fair share (token-weighted
fair queueing, router_service/fair_queue.py), then arrival order; bounded; sheds batch then standard work
first when full.

A request first tries to get a replica slot at once (`try_place`, which reserves the slot without
awaiting). If none has room, it waits as a `Ticket`. Whenever a slot frees (`pump`), waiting tickets
are offered slots in order; batch tickets only while no interactive or standard ticket waits.
When the queue is full, an arrival of a higher tier evicts the lowest waiting ticket (batch first,
then standard; the latest deadline among equals); otherwise the arrival itself is refused. Both get
RESOURCE_EXHAUSTED with a retry-after estimated from the queue length and recent service times.
A ticket whose deadline passes while it waits gets DEADLINE_EXCEEDED. `try_place` may raise a RouterError
(nothing serves or starts any more): the ticket fails with it at once.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router_service import metrics
from router_service.errors import RouterError
from router_service.fair_queue import FairShare, VirtualClock
from router_service.fair_sync import MAX_DEFER_S, TAGS_PER_TIER, Peers, Snapshot
from router_service.request import TIER_INDEX, TIERS

log = logging.getLogger(__name__)
T = TypeVar("T")
_seq = itertools.count()
REPUMP_S = 0.1  # waiting tickets also retry this often (replicas added, uncordoned, reports resumed)


@dataclass(order=True)
class Ticket(Generic[T]):
    key: tuple
    tier: str = field(compare=False)
    try_place: Callable[[], T | None] = field(compare=False, repr=False)
    future: asyncio.Future = field(compare=False, repr=False)
    request_id: str = field(compare=False, default="")
    start_tag: float = field(compare=False, default=0.0)  # fair-queueing start tag (VirtualClock)
    team: str = field(compare=False, default="")
    deferred_at: float | None = field(compare=False, default=None)  # first deferred to another router's head


class AdmissionQueue:
    def __init__(self, name: str, max_waiting: int = 256) -> None:
        self.name = name
        self.model = name.split(":")[0]
        self.max_waiting = max_waiting
        self.waiting: list[Ticket] = []
        self.service_s = 2.0  # moving average of time a slot is held, for retry-after estimates
        self.slots_hint = 1   # recent number of concurrent slots, for retry-after estimates
        self.clock = VirtualClock()
        self.peers: Peers | None = None  # other routers' heads (fair_sync.py); None with one router
        self.on_enqueue: Callable[[], None] | None = None  # fair_sync.py: publish a new head at once

    # --- public ------------------------------------------------------------------------------------
    async def admit(self, tier: str, deadline_ms: int | None, try_place: Callable[[], T | None],
                    release: Callable[[T], None], request_id: str = "",
                    cancelled: Callable[[], bool] = lambda: False, share: FairShare = FairShare()) -> T:
        """Return a placement (slot reserved) or raise RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED."""
        started = time.monotonic()
        peers = self.peers
        start_tag, finish_tag = self.clock.tag(share)
        if not self._higher_waiting(tier) and not (
                peers and peers.holding(started) and peers.ahead(TIER_INDEX[tier], finish_tag, holding=True)):
            placed = try_place()
            if placed is not None:
                self.clock.served(start_tag)
                metrics.QUEUE_WAIT.labels(self.model, tier).observe(0.0)
                return placed
        ticket = Ticket((TIER_INDEX[tier], deadline_ms or math.inf, finish_tag, next(_seq)), tier, try_place,
                        asyncio.get_running_loop().create_future(), request_id, start_tag, share.team)
        self._enqueue(ticket)
        self.pump(freed=False)
        try:
            while True:
                timeout = REPUMP_S
                if cancelled():
                    self._remove(ticket)
                    raise RouterError("cancelled", f"request {request_id} was cancelled while queued")
                if deadline_ms is not None:
                    left = deadline_ms / 1000 - time.time()
                    if left <= 0:
                        self._remove(ticket)
                        metrics.SHED.labels(self.model, tier, "deadline").inc()
                        raise RouterError("deadline_exceeded",
                                          f"deadline passed after {time.monotonic() - started:.3f} s in the "
                                          f"admission queue of {self.name}")
                    timeout = min(timeout, left)
                try:
                    placed = await asyncio.wait_for(asyncio.shield(ticket.future), timeout)
                    metrics.QUEUE_WAIT.labels(self.model, tier).observe(time.monotonic() - started)
                    return placed
                except asyncio.TimeoutError:
                    if self.waiting and self.waiting[0] is ticket:  # one waiter re-pumps for all
                        self.pump(freed=False)
        except BaseException:  # deadline, cancel, shed or the caller went away
            self._remove(ticket)
            if ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                release(ticket.future.result())  # placed at the moment the waiter gave up
            elif not ticket.future.done():
                ticket.future.cancel()
            raise

    def pump(self, freed: bool = True, first: int | None = None) -> None:
        """Offer free slots to waiting tickets in order (called whenever a slot frees; `freed` False: a retry;
        `first`: only the first few tickets). A ticket behind another router's waiting head (fair_sync.py)
        leaves the freed slot to that router."""
        if not self.waiting:
            return
        placed_any, yielded = False, 0
        peers, now = self.peers, time.monotonic()
        # Other routers' heads decide who gets a slot freed here; a retry (no slot freed here) takes what is free
        # unless this router left a slot to them lately (their view of it may be older than ours: a retry that
        # deferred to a head they have served since would idle the slot they left to us)
        holding = not freed and peers is not None and peers.holding(now)
        check = peers is not None and (freed or holding)
        for ticket in self.waiting[:first]:
            if ticket.future.done():
                self._remove(ticket)
                continue
            if ticket.tier == "batch" and any(t.tier != "batch" for t in self.waiting):
                break  # batch is admitted only while interactive and standard queues are empty
            if check and peers.ahead(ticket.key[0], ticket.key[2], holding):
                if ticket.deferred_at is None:
                    ticket.deferred_at = now
                if now - ticket.deferred_at < MAX_DEFER_S:
                    # this slot goes to another router's earlier head on its next pump; counted once the pump
                    # is over, or the next ticket here (as far behind) would see one head fewer and take it
                    yielded, freed = yielded + int(freed), False
                    continue
            try:
                placed = ticket.try_place()
            except RouterError as exc:  # e.g. the replicas it waited for stopped starting: fail it now
                self._remove(ticket)
                ticket.future.set_exception(exc)
                continue
            if placed is not None:
                self._remove(ticket)
                self.clock.served(ticket.start_tag)
                ticket.future.set_result(placed)
                placed_any = True
        if peers is not None and yielded:
            peers.yielded, peers.yielded_at = peers.yielded + yielded, now
        if placed_any:
            self._gauge()

    def fair_snapshot(self) -> Snapshot:
        """Virtual time, first waiting finish tags per tier, what each waiting team has tagged here in all
        (fair_sync.py)."""
        heads: dict[int, list[float]] = {}
        teams: dict[str, float] = {}
        for t in self.waiting:
            if not t.future.done():
                teams[t.team] = self.clock.tagged.get(t.team, 0.0)
                tags = heads.setdefault(t.key[0], [])
                if len(tags) < TAGS_PER_TIER:
                    tags.append(t.key[2])
        for tags in heads.values():
            tags.sort()
        return Snapshot(self.clock.now, heads, teams)

    def observe_service(self, seconds: float, slots: int) -> None:
        self.service_s = 0.9 * self.service_s + 0.1 * max(0.01, seconds)
        self.slots_hint = max(1, slots)

    def retry_after_ms(self) -> int:
        """How long until a slot is likely free for a new arrival: queue length x service time / slots."""
        estimate = (len(self.waiting) + 1) * self.service_s / self.slots_hint
        return int(min(30_000, max(100, estimate * 1000)))

    # --- internals -----------------------------------------------------------------------------------
    def _higher_waiting(self, tier: str) -> bool:
        """Someone of this tier or higher already waits: an arrival must not jump the queue."""
        return bool(self.waiting) and self.waiting[0].key[0] <= TIER_INDEX[tier]

    def _enqueue(self, ticket: Ticket) -> None:
        if len(self.waiting) >= self.max_waiting:
            victim = max(self.waiting, key=lambda t: t.key)  # latest deadline, then the largest fair-share tag
            retry = self.retry_after_ms()
            if victim.key[0] > ticket.key[0]:
                self._remove(victim)
                metrics.SHED.labels(self.model, victim.tier, "queue_full").inc()
                log.info("shed %s request %s from full queue %s for a %s arrival (retry after %d ms)",
                         victim.tier, victim.request_id, self.name, ticket.tier, retry)
                if not victim.future.done():
                    victim.future.set_exception(RouterError(
                        "resource_exhausted", f"shed from the full admission queue of {self.name} "
                                              f"({self.max_waiting} waiting) for higher-priority work", retry))
            else:
                metrics.SHED.labels(self.model, ticket.tier, "queue_full").inc()
                log.info("refused %s request %s: queue %s full (retry after %d ms)", ticket.tier,
                         ticket.request_id, self.name, retry)
                raise RouterError("resource_exhausted",
                                  f"admission queue of {self.name} is full ({self.max_waiting} waiting, none of "
                                  f"lower priority than {ticket.tier!r})", retry)
        bisect.insort(self.waiting, ticket)
        self._gauge()
        if self.on_enqueue is not None:
            self.on_enqueue()

    def _remove(self, ticket: Ticket) -> None:
        i = bisect.bisect_left(self.waiting, ticket)
        if i < len(self.waiting) and self.waiting[i] is ticket:
            del self.waiting[i]
            self._gauge()

    def tier_counts(self) -> dict[str, int]:
        """Tickets waiting per tier (the autoscaler reads the batch count as batch demand)."""
        counts = dict.fromkeys(TIERS, 0)
        for t in self.waiting:
            counts[t.tier] += 1
        return counts

    def earliest_deadline_ms(self, tier: str) -> float | None:
        """Earliest absolute deadline (epoch ms) among waiting tickets of a tier; None when none has one."""
        deadlines = [t.key[1] for t in self.waiting if t.tier == tier and t.key[1] != math.inf]
        return min(deadlines) if deadlines else None

    def _gauge(self) -> None:
        for tier, n in self.tier_counts().items():
            metrics.QUEUE_DEPTH.labels(self.model, tier).set(n)

