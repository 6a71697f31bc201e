"""Gateway checks per caller (docs/architecture.md, One request, step 3): request rate limit (per router, in
memory), daily token quota and concurrency cap (shared by every router, in the registry database).

API keys are looked up by their hash in the registry snapshot (`RegistryCache.caller_for_key`); the
tier and adapter rights are checked in `visibility.resolve_model`. This module holds the counters.

Quotas: at admission a request reserves prompt + max_tokens tokens and one concurrency slot in a lease row
(registry/quotas.py); when it ends the reservation is replaced by what it really used (prompt + completion).
Several routers share the rows, a restart forgets nothing, and a dead router's leases lapse. The same lease
carries the caller's shared request and token rates and the worst case reserved against its team's budget and
its key's own (registry/quotas.py), settled to what the request used.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from registry import quotas
from registry.db import session_scope

from router_service.budgets import PriceBook, ask, settled_cost
from router_service.errors import RouterError
from router_service.group_commit import GroupCommit
from router_service.registry_cache import BudgetInfo, CallerInfo

log = logging.getLogger(__name__)
DEFAULT_RATE_PER_S = 200.0  # requests per second per caller (token bucket refill)
DEFAULT_BURST = 400.0


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _ms_to_midnight() -> int:
    now = dt.datetime.now(dt.timezone.utc)
    midnight = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
    return int((midnight - now).total_seconds() * 1000)


@dataclass
class _Bucket:
    tokens: float
    updated: float


class Gateway:
    """The per-router flood guard (FLEET_ROUTER_RATE_LIMIT_RPS): it bounds what one caller can make one router
    do before the shared check; a caller's own limits are the shared ones (QuotaLedger.admit_caller)."""

    def __init__(self, rate_per_s: float = DEFAULT_RATE_PER_S, burst: float = DEFAULT_BURST) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.buckets: dict[str, _Bucket] = {}

    def check_rate(self, caller: str) -> None:
        """Token bucket per caller: `rate_per_s` requests per second, bursts up to `burst`."""
        now = time.monotonic()
        b = self.buckets.get(caller)
        if b is None:
            b = self.buckets[caller] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate_per_s)
        b.updated = now
        if b.tokens < 1:
            wait_ms = int((1 - b.tokens) / self.rate_per_s * 1000) + 1
            raise RouterError("resource_exhausted", f"rate limit: caller {caller!r} may send {self.rate_per_s:g} "
                                                    f"requests/s (burst {self.burst:g})", wait_ms)
        b.tokens -= 1


class QuotaLedger:
    """The router's handle on the shared quota and concurrency rows (registry/quotas.py)."""

    def __init__(self, db_url: str, router_id: str | None = None, prices: PriceBook | None = None) -> None:
        self.db_url = db_url
        self.router_id = router_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.prices = prices or PriceBook()
        self.leases: dict[str, str] = {}  # lease id -> caller, for the leases this router holds
        # lease id -> (team budget, key budget, model) it settles against
        self.budgeted: dict[str, tuple[BudgetInfo | None, BudgetInfo | None, str]] = {}
        # A router's quota writes take turns, each turn one transaction for every write queued by then
        # (GroupCommit). On SQLite (one writer at a time) a writer that finds the file locked sleeps in SQLite's
        # busy handler (steps of 1-100 ms): 32 requests arriving together spent 141 ms each in dispatch on
        # average before the turns. On PostgreSQL the turns keep this router's settle batches and lease
        # renewals (which lock the same lease rows) from deadlocking.
        self._turn = threading.Lock()
        self._admissions: GroupCommit[quotas.LeaseRequest] = GroupCommit(self._admit_batch)
        self._settles: GroupCommit[tuple[str, int, float, float]] = GroupCommit(self._settle_batch)

    def _admit_batch(self, items: Sequence[quotas.LeaseRequest]) -> list[object]:
        """Admit leases queued together in one transaction (GroupCommit, quotas.admit_many): None for each
        admitted, the RouterError for each refused."""
        with self._turn, session_scope(self.db_url) as s:
            refusals = quotas.admit_many(s, items, day=_today(), router_id=self.router_id)
        out: list[object] = []
        for item, result in zip(items, refusals):
            if isinstance(result, quotas.Admitted):
                self.leases[item.lease_id] = item.caller
                out.append(result.warning)
            else:
                retry = result.retry_ms or (_ms_to_midnight() if result.kind == "quota" else 1000)
                out.append(RouterError("resource_exhausted", result.message, retry))
        return out

    async def reserve(self, lease_id: str, caller: str, quota: int, tokens: int, max_concurrent: int,
                      **shared: object) -> str | None:
        """Take a lease (tokens + one concurrency slot, and what `shared` asks: team, requests_per_s,
        tokens_per_minute, budget) or raise RESOURCE_EXHAUSTED; returns a budget warning (soft limit) or None.
        Leases asked for together are written in one transaction (GroupCommit)."""
        admitted = self._admissions.submit(quotas.LeaseRequest(lease_id, caller, tokens, quota, max_concurrent,
                                                               **shared))
        try:
            return await asyncio.shield(admitted)
        except asyncio.CancelledError:  # the caller left while the lease was being taken: give it back
            admitted.add_done_callback(lambda f: f.cancelled() or f.exception() or self.settle(lease_id, 0))
            raise

    async def admit_caller(self, caller: CallerInfo, budget: BudgetInfo | None, lease_id: str, model: str,
                           prompt_tokens: int, max_tokens: int) -> str | None:
        """`reserve` with everything the caller's key and team ask of every router: quota, concurrency, request
        and token rates, and the worst case (prompt + max_tokens priced) against the team's budget and the key's
        own (`caller.budget`)."""
        claim = ask(budget, self.prices, model, prompt_tokens, max_tokens)
        key_claim = ask(caller.budget, self.prices, model, prompt_tokens, max_tokens)
        warning = await self.reserve(lease_id, caller.name, caller.token_quota_per_day, prompt_tokens + max_tokens,
                                     caller.max_concurrent, team=caller.team, requests_per_s=caller.requests_per_s,
                                     tokens_per_minute=caller.tokens_per_minute, budget=claim, key_budget=key_claim)
        if budget is not None or caller.budget is not None:
            self.budgeted[lease_id] = (budget, caller.budget, model)
        return warning

    async def settle_request(self, lease_id: str, prompt: int, cached: int, completion: int) -> None:
        """Settle a request's lease to what it used: tokens, and its cost in each budget's unit (team, key)."""
        budget, key_budget, model = self.budgeted.pop(lease_id, (None, None, ""))
        await self.settle_off_loop(lease_id, prompt + completion,
                                   settled_cost(budget, self.prices, model, prompt, cached, completion),
                                   settled_cost(key_budget, self.prices, model, prompt, cached, completion))

    def settle(self, lease_id: str, actual: int, cost: float = 0.0, key_cost: float = 0.0) -> None:
        """Replace a lease's reservation by the tokens the request really used (idempotent; never raises)."""
        self.budgeted.pop(lease_id, None)
        self._settle_batch([(lease_id, actual, cost, key_cost)])

    def _settle_batch(self, items: Sequence[tuple[str, int, float, float]]) -> list[object]:
        mine = [item for item in items if self.leases.pop(item[0], None) is not None]
        if mine:
            try:
                with self._turn, session_scope(self.db_url) as s:
                    quotas.settle_many(s, mine)
            except Exception as exc:  # the leases lapse on their own; metering (usage events) is unaffected
                log.warning("could not settle quota leases %s: %s", ", ".join(item[0] for item in mine), exc)
        return [None] * len(items)

    async def settle_off_loop(self, lease_id: str, actual: int, cost: float = 0.0, key_cost: float = 0.0) -> None:
        """`settle`, its write on a worker thread, together with the other settles queued by then: a SQLite
        write of ~2.4 ms (more while admissions take their turns) at the end of every request held up every
        other stream's tokens on the event loop. The caller resumes once it is written, so a slot given back
        is free for the caller's next request, on any router."""
        if lease_id in self.leases:
            await self._settles.submit((lease_id, actual, cost, key_cost))

    def usage_today(self, caller: str) -> dict:
        with session_scope(self.db_url) as s:
            return quotas.usage(s, caller, _today())

    async def renew_forever(self, every_s: float = quotas.LEASE_TTL_S / 4) -> None:
        """Keep this router's leases alive while it runs (a dead router's lapse after LEASE_TTL_S)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self._renew)
            except Exception as exc:
                log.warning("quota lease renewal failed: %s", exc)

    def _renew(self) -> None:
        with self._turn, session_scope(self.db_url) as s:
            quotas.renew(s, self.router_id)
