"""Admission queue: order (priority, deadline), bounded with shedding of batch/standard first,
deadlines while queued, batch only while interactive/standard queues are empty."""
import asyncio
import time

import pytest

from router_service.admission import AdmissionQueue
from router_service.errors import RouterError


class Slots:
    """A fake replica pool of n slots; placements are the order of admission."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.admitted: list[str] = []

    def placer(self, name: str):
        def try_place():
            if self.free <= 0:
                return None
            self.free -= 1
            self.admitted.append(name)
            return name
        return try_place

    def release(self, _placement) -> None:
        self.free += 1


def _ms(from_now_s: float) -> int:
    return int((time.time() + from_now_s) * 1000)


async def _admit(q, slots, name, tier, deadline=None):
    return await q.admit(tier, deadline, slots.placer(name), slots.release, name)


def test_waiters_are_served_by_priority_then_deadline():
    async def main():
        q, slots = AdmissionQueue("m:1", 16), Slots(1)
        assert await _admit(q, slots, "first", "standard") == "first"
        tasks = [asyncio.create_task(_admit(q, slots, name, tier, dl)) for name, tier, dl in (
            ("b1", "batch", None), ("s-late", "standard", _ms(60)), ("i1", "interactive", None),
            ("s-soon", "standard", _ms(30)))]
        await asyncio.sleep(0.01)
        for _ in range(4):
            slots.release(None)
            q.pump()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return slots.admitted
    assert asyncio.run(main()) == ["first", "i1", "s-soon", "s-late", "b1"]


def test_full_queue_sheds_batch_first_and_never_interactive_while_batch_waits():
    async def main():
        q, slots = AdmissionQueue("m:1", 2), Slots(0)
        b = asyncio.create_task(_admit(q, slots, "b", "batch"))
        s = asyncio.create_task(_admit(q, slots, "s", "standard"))
        await asyncio.sleep(0.01)
        i1 = asyncio.create_task(_admit(q, slots, "i1", "interactive"))  # evicts the batch request
        await asyncio.sleep(0.01)
        with pytest.raises(RouterError) as shed:
            await b
        assert shed.value.code == "resource_exhausted" and shed.value.retry_after_ms >= 100
        i2 = asyncio.create_task(_admit(q, slots, "i2", "interactive"))  # then the standard one
        await asyncio.sleep(0.01)
        with pytest.raises(RouterError):
            await s
        with pytest.raises(RouterError, match="full") as refused:  # a batch arrival is refused outright
            await _admit(q, slots, "b2", "batch")
        assert refused.value.retry_after_ms is not None
        for _ in range(2):
            slots.release(None)
            q.pump()
        assert {await i1, await i2} == {"i1", "i2"}
    asyncio.run(main())


def test_deadline_passing_in_the_queue_is_deadline_exceeded():
    async def main():
        q, slots = AdmissionQueue("m:1", 4), Slots(0)
        t0 = time.monotonic()
        with pytest.raises(RouterError) as info:
            await _admit(q, slots, "x", "standard", _ms(0.15))
        assert info.value.code == "deadline_exceeded" and time.monotonic() - t0 >= 0.1  # not before the deadline
        assert not q.waiting
    asyncio.run(main())


def test_batch_waits_while_interactive_waits_and_cancel_leaves_the_queue():
    async def main():
        q, slots = AdmissionQueue("m:1", 8), Slots(0)
        i = asyncio.create_task(_admit(q, slots, "i", "interactive"))
        await asyncio.sleep(0.01)
        slots.free = 1  # a slot frees without a pump: a batch arrival must not take it
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(_admit(q, slots, "b", "batch"), 0.05)
        assert await i == "i" and slots.admitted == ["i"]
        c = asyncio.create_task(_admit(q, slots, "c", "standard"))
        await asyncio.sleep(0.01)
        c.cancel()
        await asyncio.sleep(0.01)
        assert not q.waiting
    asyncio.run(main())


def test_preempt_mode_holds_batch_while_interactive_is_active_and_preempts_running_batch():
    from router_service.batch_yield import BatchYield
    from router_service.cancellation import CancelHandle

    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    async def main():
        by = BatchYield("preempt", grace_s=0.5)  # long enough that "still in grace" holds on a loaded machine
        running = CancelHandle("b1", "c")
        running.upstream = Call()
        by.batch_started("m:1", running)
        assert by.batch_may_start("m:1")
        by.interactive_arrived("m:1")
        by.interactive_started("m:1")
        assert running.preempted and running.upstream.cancelled and not running.cancelled
        assert not by.batch_may_start("m:1")
        by.interactive_ended("m:1")
        assert not by.batch_may_start("m:1")  # grace period
        await asyncio.sleep(0.55)
        assert by.batch_may_start("m:1")
        share = BatchYield("share")
        share.batch_started("m:1", CancelHandle("b2", "c"))
        share.interactive_arrived("m:1")
        assert share.batch_may_start("m:1")
    asyncio.run(main())
