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
    migrate(db_url)
    a, b = QuotaLedger(db_url, "router-a"), QuotaLedger(db_url, "router-b")
    asyncio.run(a.reserve("first", "c", 10**9, 10, 1))

    async def settle_while_the_turn_is_held() -> int:
        ticks = 0
        a._turn.acquire()                   # another write of this router holds its turn
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


def test_admissions_arriving_together_share_transactions_and_keep_every_limit(db_url):
    """A burst of admissions is written in a few transactions (GroupCommit), not one each, and each request
    still gets its own answer: the cap and quota refuse exactly the requests beyond them, naming why, and a
    refused request takes nothing from the others in its transaction."""
    migrate(db_url)
    ledger = QuotaLedger(db_url, "router-a")

    async def burst() -> dict[str, str]:
        async def one(lease: str, caller: str, quota: int, cap: int) -> str:
            try:
                await ledger.reserve(lease, caller, quota, 100, cap)
                return "ok"
            except RouterError as exc:
                assert exc.code == "resource_exhausted" and exc.retry_after_ms > 0
                return exc.message
        jobs = {f"capped-{i}": one(f"capped-{i}", "capped", 10**9, 3) for i in range(8)}
        jobs |= {f"quota-{i}": one(f"quota-{i}", "quota", 250, 0) for i in range(4)}   # room for two
        jobs |= {f"free-{i}": one(f"free-{i}", "free", 10**9, 0) for i in range(8)}
        return dict(zip(jobs, await asyncio.gather(*jobs.values())))
    answers = asyncio.run(burst())
    by_caller = lambda c: [answers[k] for k in sorted(answers) if k.startswith(c)]  # noqa: E731
    assert by_caller("capped").count("ok") == 3
    assert all("cap is 3" in a for a in by_caller("capped") if a != "ok")
    assert by_caller("quota").count("ok") == 2
    assert all("has used 200 of 250" in a for a in by_caller("quota") if a != "ok")
    assert by_caller("free") == ["ok"] * 8
    assert ledger._admissions.batches < len(answers)    # the burst shared transactions
    assert ledger.usage_today("capped")["inflight"] == 3 and ledger.usage_today("free")["inflight"] == 8

    async def settle_all() -> None:
        await asyncio.gather(*(ledger.settle_off_loop(k, 40) for k, a in answers.items() if a == "ok"))
    asyncio.run(settle_all())
    assert ledger._settles.batches < 13
    for caller, n in (("capped", 3), ("quota", 2), ("free", 8)):
        assert ledger.usage_today(caller) | {"day": None} == {"day": None, "used": 40 * n, "reserved": 0,
                                                              "inflight": 0}


def test_a_failed_transaction_fails_each_writer_in_it_and_the_next_batch_goes_on():
    from router_service.group_commit import GroupCommit
    calls: list[list[int]] = []

    def run(items):
        calls.append(list(items))
        if 13 in items:
            raise RuntimeError("database gone")
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]
    commit: GroupCommit[int] = GroupCommit(run)

    async def main():
        lone = await commit.submit(2)                     # a lone write goes at once, alone
        futures = [commit.submit(i) for i in (13, 4)]     # queued together: one transaction, which fails
        failed = await asyncio.gather(*futures, return_exceptions=True)
        after = await asyncio.gather(*(commit.submit(i) for i in (5, 6)), return_exceptions=True)
        return lone, failed, after
    lone, failed, after = asyncio.run(main())
    assert lone == 20 and calls[0] == [2]
    assert [str(e) for e in failed] == ["database gone", "database gone"] and calls[1] == [13, 4]
    assert str(after[0]) == "odd 5" and after[1] == 60 and commit.batches == 3


def test_a_caller_that_leaves_while_its_lease_is_written_gets_it_given_back(db_url):
    migrate(db_url)
    ledger = QuotaLedger(db_url, "router-a")

    async def main():
        ledger._turn.acquire()             # the write is queued behind another one
        task = asyncio.create_task(ledger.reserve("gone", "c", 10**9, 10, 1))
        await asyncio.sleep(0.05)
        task.cancel()
        ledger._turn.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):               # the lease is written, then given back at once
            if "gone" not in ledger.leases and ledger._admissions.batches:
                break
            await asyncio.sleep(0.02)
    asyncio.run(main())
    assert ledger.usage_today("c")["inflight"] == 0
    asyncio.run(ledger.reserve("next", "c", 10**9, 10, 1))   # the cap of 1 is free again
