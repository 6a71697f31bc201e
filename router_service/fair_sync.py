"""Fair shares across routers: a shared virtual clock over the registry database (issue 37).

Each router's admission queues do start-time fair queueing (router_service/fair_queue.py) on their own. When
the load is skewed (all of team A's connections on router 1, team B's on router 2) every router admits its own
head whenever a slot frees, and router 1 took most freed slots: B waited 5.7-11x its TTFT alone. So every
`interval_s` (20 ms) each router, per admission queue with requests waiting, writes one row (`fair_heads`):

- its virtual time, so that the virtual time is shared (the max over routers) and tags are comparable;
- the finish tag of its best waiting request per tier;
- what each team it has waiting has tagged there in all (tokens / weight): another router adds the growth
  since its last read to the team's last finish tag, so a team spread over routers has one sequence of tags
  advancing with all its requests, not one per router (a max over routers would let the sequences overlap
  during each exchange's lag: a team sending 4x on both routers got 1.6x the other's tokens).

and reads the other routers' rows. A slot freed on a router goes to its own waiting ticket only when no other
router's fresh head is ahead of it (a higher tier, or the same tier and an earlier finish tag): otherwise it is
left, and the other router takes it on its next retry (every `PUMP_S` while it has requests waiting). For
`HOLD_S` after leaving one, a router's retries defer to the others' heads too; any other retry takes what is
free (the others' view may be older than this router's: deferring to a head already served idled the slot
they had left; AdmissionQueue.pump).

What keeps a slot from idling:
- a row counts only while its `seq` keeps changing (seen by this router's monotonic clock, so clock skew
  between hosts does not matter): a dead or stuck router's heads stop counting after `ttl_s`;
- a ticket defers at most `max_defer_s` in all (a peer whose head cannot be placed, e.g. its replicas are
  excluded for it, does not hold this router's slot for longer);
- when the database cannot be read, the peers are forgotten and each router is fair on its own again.

The error against one queue for the whole tier: a head is seen up to one exchange late (~interval_s + the
write), and a deferred slot waits for the other router's next pump; on real replicas the other router also sees
the freed slot only at the replica's next load report (~200 ms, shared_load.py). bench/router/fair_share.py
measures it (`--sync memory` or `--sync URL`).

Single router: FairSync runs on every router (Kubernetes runs N pods of one router each, so a router cannot
know it is alone), but while no other router's row is fresh it exchanges only every `ALONE_S` (250 ms: a
heartbeat, so that a router that starts finds it) and AdmissionQueue.peers stays None: the admission path is
unchanged. A router that finds a fresh peer switches to `interval_s`.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from registry.db import session_scope
from registry.schema import FairHead

log = logging.getLogger(__name__)

INTERVAL_S = 0.02     # exchange period (an enqueue wakes it sooner)
ALONE_S = 0.25        # exchange period while no other router's row is fresh (one router: 4 exchanges/s)
MIN_GAP_S = 0.005     # at most one exchange per 5 ms however often enqueues wake it
PUMP_S = 0.002        # between exchanges, a queue whose head goes first retries this often (a slot left to it)
TAGS_PER_TIER = 32    # a router publishes its first 32 finish tags per tier
TTL_S = 1.0           # a peer row whose seq has not changed for this long no longer counts (dead router)
MAX_DEFER_S = 0.5     # a ticket defers to other routers' heads at most this long in all
HOLD_S = 0.02         # a slot left to another router is not retaken by a retry here for this long
PURGE_S = 300.0       # rows not written for this long (wall clock) are deleted by any router


@dataclass(frozen=True)
class Snapshot:
    """One queue's fair-queueing state as a router publishes it."""
    vt: float
    heads: dict[int, list[float]]  # tier index -> first waiting finish tags, ascending
    teams: dict[str, float]      # team -> tokens / weight tagged there in all, for teams with waiting tickets


PeerRow = tuple[str, str, int, Snapshot]   # (router id, queue, seq, snapshot) of another router


@dataclass
class Peers:
    """What the other routers published for one admission queue, fresh rows only, folded: the max virtual
    time and the waiting finish tags per tier. `yielded`: freed slots this router left to them since the last
    exchange; it defers only while more of their tickets are ahead than that, so a stale view (heads already
    served) idles at most as many slots as it showed tickets. For `HOLD_S` after a yield, only a freed slot
    counts that way: a retry here must not take the slot just left to them before their next pump does."""
    vt: float = 0.0
    tags: dict[int, list[float]] = field(default_factory=dict)
    yielded: int = 0
    yielded_at: float = -math.inf   # monotonic time of the last yield

    def ahead(self, tier: int, tag: float, holding: bool = False) -> int:
        """How many of the other routers' waiting tickets go before (tier index `tier`, finish tag `tag`),
        beyond the slots already yielded to them unless `holding` (0: this ticket may take a slot)."""
        n = 0
        for t, tags in self.tags.items():
            n += len(tags) if t < tier else bisect.bisect_left(tags, tag) if t == tier else 0
        return n if holding else max(0, n - self.yielded)

    def holding(self, now: float) -> bool:
        """A slot left to the others lately may still be free, waiting for their pump."""
        return now - self.yielded_at < HOLD_S


class FairStore(Protocol):
    def exchange(self, router_id: str, publish: Mapping[str, Snapshot], seq: int) -> list[PeerRow]:
        """Write this router's rows (`publish`, queue -> snapshot) and return every other router's rows as
        (router_id, queue, seq, snapshot)."""
        ...


class SqlFairStore:
    """The `fair_heads` table of the registry database (SQLite or PostgreSQL)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self._purged = 0.0

    def exchange(self, router_id: str, publish: Mapping[str, Snapshot], seq: int) -> list[PeerRow]:
        now = time.time()
        with session_scope(self.db_url) as s:
            insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
            for queue, snap in sorted(publish.items()):   # one order: two routers' writes cannot deadlock
                values = dict(router_id=router_id, queue=queue, seq=seq, vt=snap.vt,
                              heads={str(k): list(v) for k, v in snap.heads.items()}, teams=snap.teams, updated_at=now)
                stmt = insert(FairHead).values(**values)
                s.execute(stmt.on_conflict_do_update(index_elements=["router_id", "queue"], set_={
                    k: stmt.excluded[k] for k in ("seq", "vt", "heads", "teams", "updated_at")}))
            if now - self._purged > PURGE_S / 10:
                self._purged = now
                s.execute(delete(FairHead).where(FairHead.updated_at < now - PURGE_S))
            rows = s.execute(select(FairHead).where(FairHead.router_id != router_id,
                                                    FairHead.updated_at > now - PURGE_S)).scalars().all()
            return [(r.router_id, r.queue, r.seq,
                     Snapshot(r.vt, {int(k): [float(x) for x in v] for k, v in (r.heads or {}).items()},
                              {k: float(v) for k, v in (r.teams or {}).items()}))
                    for r in rows]


class FairSync:
    """One router's exchange loop over its admission queues (`queues`: the Router's dict, read live)."""

    def __init__(self, store: FairStore, router_id: str, queues: Mapping[str, object],
                 interval_s: float = INTERVAL_S, ttl_s: float = TTL_S) -> None:
        self.store, self.router_id, self.queues = store, router_id, queues
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.seq = 0
        self._published: dict[str, Snapshot] = {}
        self._seen: dict[tuple[str, str], tuple[int, float]] = {}   # (router, queue) -> (seq, monotonic changed)
        self.wake = asyncio.Event()   # set by an admission queue on enqueue: publish the new head now
        self.peer_seen_at = -math.inf  # monotonic time another router's row was last fresh
        self._tagged: dict[tuple[str, str, str], float] = {}   # (router, queue, team) -> tagged, last read

    def alone(self) -> bool:
        """No other router's row has been fresh for `ttl_s`: exchange slowly."""
        return time.monotonic() - self.peer_seen_at > self.ttl_s

    async def run_forever(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # the database is down: forget the peers, each router is fair alone
                log.warning("fair-share exchange failed (%s); admission queues use local fair shares", exc)
                for q in list(self.queues.values()):
                    q.peers = None
                await asyncio.sleep(1.0)
            await self.between_exchanges()

    async def between_exchanges(self) -> None:
        """Wait up to `interval_s` (less when an enqueue wakes it), and meanwhile retry the head of each queue
        whose head goes before every other router's: the slot another router left to it frees there, and this
        router learns of it only by trying (on real replicas, from the replica's next report)."""
        if self.alone():   # nobody to share with: a slow heartbeat so that a router that starts finds this one
            await asyncio.sleep(ALONE_S)
            self.wake.clear()
            return
        started = time.monotonic()
        while True:
            await asyncio.sleep(PUMP_S)
            waited = time.monotonic() - started
            if waited >= self.interval_s or (self.wake.is_set() and waited >= MIN_GAP_S):
                break
            for q in list(self.queues.values()):
                if q.peers is not None and q.waiting:
                    q.pump(freed=False, first=1)
        self.wake.clear()

    async def tick(self) -> None:
        """Publish what changed (and a heartbeat while requests wait), read the peers, pump waiting queues."""
        queues = dict(self.queues)
        publish = {}
        for name, q in queues.items():
            snap = q.fair_snapshot()
            if snap.heads or self._published.get(name) != snap:
                publish[name] = snap
        self.seq += 1
        rows = await asyncio.to_thread(self.store.exchange, self.router_id, publish, self.seq)
        self._published.update(publish)
        self.apply(rows, queues)

    def apply(self, rows: list[PeerRow], queues: Mapping[str, object]) -> None:
        now = time.monotonic()
        folded: dict[str, Peers] = {}
        grown: dict[str, dict[str, float]] = {}   # queue -> team -> what other routers tagged since the last read
        tagged: dict[tuple[str, str, str], float] = {}
        seen_now: dict[tuple[str, str], tuple[int, float]] = {}   # rows still in the table: a purged one is forgotten
        for router_id, queue, seq, snap in rows:
            key = (router_id, queue)
            seen = self._seen.get(key)
            if seen is None or seen[0] != seq:
                seen = (seq, now)
            seen_now[key] = seen
            if now - seen[1] > self.ttl_s:
                continue            # not rewritten lately: a dead router, or one with nothing waiting
            p = folded.setdefault(queue, Peers())
            p.vt = max(p.vt, snap.vt)
            for tier, tags in snap.heads.items():
                p.tags[tier] = sorted(p.tags.get(tier, []) + tags)
            for team, total in snap.teams.items():
                tagged[(router_id, queue, team)] = total
                before = self._tagged.get((router_id, queue, team))
                if before is not None and total > before:   # first sight or a restart: no growth known
                    g = grown.setdefault(queue, {})
                    g[team] = g.get(team, 0.0) + total - before
        self._tagged, self._seen = tagged, seen_now
        if folded:
            self.peer_seen_at = now
        for name, q in queues.items():
            p = folded.get(name)
            q.peers = p
            q.on_enqueue = self.wake.set
            if p is not None:
                q.clock.now = max(q.clock.now, p.vt)
            for team, cost in grown.get(name, {}).items():
                q.clock.advance(team, cost)
            if q.waiting:
                q.pump(freed=False)  # a peer's head may have been served: this router's turn
