"""GroupCommit: database writes that arrive together share one transaction, off the event loop.

A burst of requests each taking a quota lease in its own transaction waits in line: SQLite has one writer at a
time, and every commit syncs the write-ahead log. 32 requests arriving at once through `fleet up` (SQLite)
spent 106-115 ms each in the router before their upstream call (`fleet_router_dispatch_seconds`, mean), most of
it waiting for the commits ahead of them; 17-22 ms with the batches (`python -m bench.engine.platform_profile`). Here a write is queued and the first writer's worker thread takes every
write queued by then into one transaction; writes that arrive while it runs form the next batch. No timer:
a lone write goes at once, as before.

`run_batch(items)` (called on a worker thread) returns one result per item, in order, each a value or an
exception *instance* that belongs to that item alone (e.g. a refused quota); an exception it raises belongs to
the whole batch (the transaction failed: nothing of it was written) and is raised to every writer in it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")


class GroupCommit(Generic[Item]):
    def __init__(self, run_batch: Callable[[Sequence[Item]], list[object]]) -> None:
        self._run_batch = run_batch
        # per event loop (a router has one; tests run several, each on its own thread): a future is resolved
        # on the loop that awaits it
        self._queued: dict[asyncio.AbstractEventLoop, list[tuple[Item, asyncio.Future]]] = {}
        self._workers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self.batches = 0          # transactions run (tests read it)

    def submit(self, item: Item) -> asyncio.Future:
        """Queue `item`; the future resolves to its result (or raises its exception) once its batch committed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued.setdefault(loop, []).append((item, future))
        worker = self._workers.get(loop)
        if worker is None or worker.done():
            self._workers[loop] = loop.create_task(self._drain(loop))
        return future

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        queued = self._queued[loop]
        try:
            while queued:
                batch = queued[:]
                queued.clear()
                try:
                    results = await asyncio.to_thread(self._run_batch, [item for item, _ in batch])
                except Exception as exc:  # the transaction failed: every write in it failed
                    results = [exc] * len(batch)
                self.batches += 1
                for (_, future), result in zip(batch, results):
                    if future.done():     # its writer's loop is closing
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            if not queued:                # nothing left for this loop: forget it (no await since the check)
                self._queued.pop(loop, None)
                self._workers.pop(loop, None)
