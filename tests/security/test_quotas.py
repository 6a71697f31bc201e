"""Quotas and the per-caller concurrency cap live in the registry database (SQLite and PostgreSQL): several
routers share them (no N x quota), a restart forgets nothing, concurrent admissions cannot overshoot, and a
dead router's leases lapse. Before this, quotas were per router and in memory."""
from __future__ import annotations

import asyncio
import threading

import pytest

from registry import quotas
from registry.db import migrate, session_scope
from router_service.errors import RouterError
from router_service.gateway import QuotaLedger


@pytest.fixture
def ledgers(db_url):
    migrate(db_url)
    return QuotaLedger(db_url, "router-a"), QuotaLedger(db_url, "router-b")


def test_two_routers_share_one_daily_quota_and_a_restart_remembers(ledgers, db_url):
    a, b = ledgers
    asyncio.run(a.reserve("r1", "c", 1000, 600, 0))
    with pytest.raises(RouterError, match="used 600 of 1000") as info:  # the other router sees the reservation
        asyncio.run(b.reserve("r2", "c", 1000, 600, 0))
    assert info.value.code == "resource_exhausted" and info.value.retry_after_ms > 0
    a.settle("r1", 100)  # it really used 100 tokens
    asyncio.run(b.reserve("r2", "c", 1000, 600, 0))
    assert b.usage_today("c") | {"day": None} == {"day": None, "used": 100, "reserved": 600, "inflight": 1}
    b.settle("r2", 600)
    restarted = QuotaLedger(db_url, "router-a-restarted")
    with pytest.raises(RouterError, match="used 700 of 1000"):
        asyncio.run(restarted.reserve("r3", "c", 1000, 400, 0))


def test_concurrency_cap_holds_across_routers_under_a_race(ledgers):
    a, b = ledgers
    admitted, refused = [], []

    def one(i: int) -> None:
        ledger = a if i % 2 else b
        try:
            asyncio.run(ledger.reserve(f"req-{i}", "c", 10**9, 10, 3))
            admitted.append(i)
        except RouterError as exc:
            assert exc.code == "resource_exhausted" and "concurrency" in exc.message and "cap is 3" in exc.message
            refused.append(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 3 and len(refused) == 9
    (a if admitted[0] % 2 else b).settle(f"req-{admitted[0]}", 10)
    asyncio.run(a.reserve("late", "c", 10**9, 10, 3))  # a freed slot is usable again


def test_a_dead_routers_leases_lapse(ledgers, db_url):
    a, b = ledgers
    asyncio.run(a.reserve("r1", "c", 10**9, 10, 1))
    with pytest.raises(RouterError, match="concurrency"):
        asyncio.run(b.reserve("r2", "c", 10**9, 10, 1))
    later = __import__("time").time() + quotas.LEASE_TTL_S + 1  # router-a stopped renewing a minute ago
    with session_scope(db_url) as s:
        quotas.admit(s, lease_id="r3", caller="c", day=quotas_day(), router_id="router-b", tokens=10, quota=10**9,
                     max_concurrent=1, now=later)


def quotas_day() -> str:
    from router_service.gateway import _today
    return _today()


def test_settling_at_a_streams_end_leaves_the_event_loop_free(db_url):
    """The router settles a finished request off its event loop (other streams keep moving while the write
    waits its turn), and returns only once it is written: the freed slot is usable at once, on any router."""
    if not db_url.startswith("sqlite"):
        pytest.skip("the writers' turn that this test holds exists on SQLite only")
    migrate(db_url)
    a, b = QuotaLedger(db_url, "router-a"), QuotaLedger(db_url, "router-b")
    asyncio.run(a.reserve("first", "c", 10**9, 10, 1))

    async def settle_while_the_turn_is_held() -> int:
        ticks = 0
        a._turn.acquire()                   # another write of this router holds SQLite's one writer slot
        settling = asyncio.create_task(a.settle_off_loop("first", 7))
        while ticks < 5:                    # the loop keeps serving while the settle waits its turn
            await asyncio.sleep(0.01)
            ticks += 1
        assert not settling.done()
        a._turn.release()
        await settling
        return ticks
    assert asyncio.run(settle_while_the_turn_is_held()) == 5
    asyncio.run(b.reserve("second", "c", 10**9, 10, 1))     # the slot is free at once, on the other router
    assert b.usage_today("c") | {"day": None} == {"day": None, "used": 7, "reserved": 10, "inflight": 1}
