"""Daily token quotas and per-caller concurrency caps, kept in the registry database so that every router
shares them and a restart forgets nothing.

Each request in flight holds a lease row (`inflight_leases`): its token reservation (prompt + max_tokens)
and one concurrency slot. Admission runs in one transaction that first writes the caller's `quota_usage`
row: that write takes the row lock on PostgreSQL (the database write lock on SQLite), so admissions of one
caller are serialised across routers and the check "used + reserved + asked <= quota and leases < cap"
cannot be raced. Settling deletes the lease and adds what the request really used. A router renews its
leases every few seconds; one that dies stops renewing, and its leases lapse after `LEASE_TTL_S`.

The same transaction checks the caller's shared request and token rates (registry/rate_limits.py, under the
caller's row lock) and its team's budget (registry/budgets.py: the team-period `budget_spend` row is locked after
every caller row, teams in name order, so the lock order is total and batches of several routers cannot wait on
each other in a cycle): spent + live reservations + this request's worst case must stay within the amount.
A key's own budget (optional, registry/budgets.py KEY) is checked the same way; its spend rows are locked
after every caller row and before the team rows (callers in name order).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from registry import budgets, rate_limits
from registry.schema import InflightLease, QuotaUsage

# A dead router's leases (tokens, concurrency slot, budget reservation) lapse this long after its last renewal
# (routers renew every LEASE_TTL_S / 4).
LEASE_TTL_S = 20.0


class QuotaRefused(Exception):
    def __init__(self, kind: str, message: str, retry_ms: int | None = None) -> None:
        super().__init__(message)
        # kind: "quota", "concurrency", "rate" or "budget"; retry_ms: when a retry may pass (None: the caller's)
        self.kind, self.message, self.retry_ms = kind, message, retry_ms


@dataclass(frozen=True)
class BudgetAsk:
    """A request's claim on its team's budget: the budget as the router read it and the request's worst case."""
    period: str            # period key, e.g. '2026-12'
    period_kind: str       # month | day
    amount: float
    unit: str              # money | tokens
    soft_share: float
    enforce: bool
    cost: float            # worst case (prompt + max_tokens priced) in `unit`


@dataclass(frozen=True)
class Admitted:
    warning: str | None = None  # the team passed its budget's soft share


def _lock_usage_row(session: Session, caller: str, day: str) -> int:
    """Create the caller-day row if missing and write-lock it; returns the tokens used so far."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(QuotaUsage).values(caller=caller, day=day, used_tokens=0).on_conflict_do_nothing())
    session.execute(update(QuotaUsage).where(QuotaUsage.caller == caller, QuotaUsage.day == day)
                    .values(used_tokens=QuotaUsage.used_tokens))
    return int(session.scalar(select(QuotaUsage.used_tokens).where(QuotaUsage.caller == caller,
                                                                   QuotaUsage.day == day)) or 0)


def _live(session: Session, caller: str, day: str, now: float) -> tuple[int, int]:
    """(leases in flight, tokens they reserve today) of a caller, in one query (it runs for every admission)."""
    today = case((InflightLease.day == day, InflightLease.reserved_tokens), else_=0)
    row = session.execute(select(func.count(), func.coalesce(func.sum(today), 0))
                          .where(InflightLease.caller == caller, InflightLease.expires_at > now)).one()
    return int(row[0] or 0), int(row[1] or 0)


@dataclass(frozen=True)
class LeaseRequest:
    lease_id: str
    caller: str
    tokens: int            # reservation: prompt + max_tokens
    quota: int             # the caller's tokens per day
    max_concurrent: int    # 0 = no cap
    team: str = ""
    requests_per_s: float = 0.0   # shared limits (0 = none)
    tokens_per_minute: int = 0
    budget: BudgetAsk | None = None       # the team's budget
    key_budget: BudgetAsk | None = None   # the key's own budget


def admit_many(session: Session, requests: Sequence[LeaseRequest], *, day: str, router_id: str,
               now: float | None = None) -> list[QuotaRefused | Admitted]:
    """Take a lease for each request, in order, in the session's transaction: Admitted where taken, the
    QuotaRefused where not (a refusal writes nothing of its own; the others in the batch still commit).
    Each caller's row is locked once, callers in name order, then each budgeted team's spend row, teams in
    name order, so batches never wait on each other in a cycle; later requests see earlier ones' leases."""
    now = time.time() if now is None else now
    out: list[QuotaRefused | Admitted] = [Admitted()] * len(requests)
    by_caller: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_caller.setdefault(r.caller, []).append(i)
    state: dict[str, list] = {}
    for caller in sorted(by_caller):
        used = _lock_usage_row(session, caller, day)
        count, reserved = _live(session, caller, day, now)
        rates = (rate_limits.row_for(session, caller)
                 if any(requests[i].requests_per_s or requests[i].tokens_per_minute for i in by_caller[caller]) else None)
        state[caller] = [used, count, reserved, rates]
    keys: dict[tuple[str, str], float] = {}   # (caller, period) -> spent + reserved of the key's own budget
    for caller, period in sorted({(r.caller, r.key_budget.period) for r in requests if r.key_budget is not None}):
        keys[caller, period] = budgets.lock_spend(session, caller, period, budgets.KEY) + \
            budgets.reserved(session, caller, period, now, budgets.KEY)
    teams: dict[tuple[str, str], float] = {}  # (team, period) -> spent + reserved
    for team, period in sorted({(r.team, r.budget.period) for r in requests if r.budget is not None}):
        teams[team, period] = budgets.lock_spend(session, team, period) + budgets.reserved(session, team, period, now)
    for i, r in enumerate(requests):
        used, count, reserved, rates = state[r.caller]
        b, kb = r.budget, r.key_budget
        committed = teams.get((r.team, b.period), 0.0) if b is not None else 0.0
        key_committed = keys.get((r.caller, kb.period), 0.0) if kb is not None else 0.0
        if r.max_concurrent and count >= r.max_concurrent:
            out[i] = QuotaRefused("concurrency", f"concurrency: caller {r.caller!r} has {count} requests in "
                                                 f"flight; its cap is {r.max_concurrent}")
            continue
        if used + reserved + r.tokens > r.quota:
            out[i] = QuotaRefused("quota", f"token quota: caller {r.caller!r} has used {used + reserved} of "
                                           f"{r.quota} tokens today (UTC); this request needs up to {r.tokens} "
                                           f"(prompt + max_tokens)")
            continue
        if b is not None and b.enforce and committed + b.cost > b.amount:
            out[i] = _budget_refusal(f"team {r.team!r}", b, committed, now)
            continue
        if kb is not None and kb.enforce and key_committed + kb.cost > kb.amount:
            out[i] = _budget_refusal(f"key {r.caller!r}", kb, key_committed, now)
            continue
        if rates is not None:
            refused = rate_limits.take(rates, now, r.requests_per_s, r.tokens_per_minute, r.tokens)
            if refused is not None:
                out[i] = QuotaRefused("rate", refused.message, refused.retry_ms)
                continue
        state[r.caller][1:3] = [count + 1, reserved + r.tokens]
        warnings = []
        if b is not None:
            teams[r.team, b.period] = committed + b.cost
            warnings.append(_soft_warning(f"team {r.team!r}", b, committed, now))
        if kb is not None:
            keys[r.caller, kb.period] = key_committed + kb.cost
            warnings.append(_soft_warning(f"key {r.caller!r}", kb, key_committed, now))
        out[i] = Admitted("; ".join(w for w in warnings if w) or None)
        session.add(InflightLease(lease_id=r.lease_id, caller=r.caller, day=day, router_id=router_id,
                                  reserved_tokens=r.tokens, expires_at=now + LEASE_TTL_S, team=r.team,
                                  budget_period=b.period if b is not None else "",
                                  budget_reserved=b.cost if b is not None else 0.0,
                                  tpm_minute=int(now // rate_limits.MINUTE_S) if rates is not None else 0,
                                  key_budget_period=kb.period if kb is not None else "",
                                  key_budget_reserved=kb.cost if kb is not None else 0.0))
    return out


_ADJECTIVE = {"month": "monthly", "day": "daily"}


def _amount(value: float, unit: str) -> str:
    return f"{value:,.0f} tokens" if unit == "tokens" else f"{value:,.6f}"


def _soft_warning(owner: str, b: BudgetAsk, committed: float, now: float) -> str | None:
    """The soft-limit warning once the owner's committed spend with this request reaches the soft share."""
    if committed + b.cost < b.soft_share * b.amount:
        return None
    return (f"{owner} has used or reserved {_amount(committed + b.cost, b.unit)} of its "
            f"{_ADJECTIVE[b.period_kind]} budget of {_amount(b.amount, b.unit)} ({b.period}; resets "
            f"{budgets.resets_at(b.period_kind, now).isoformat()})")


def _budget_refusal(owner: str, b: BudgetAsk, committed: float, now: float) -> QuotaRefused:
    """owner: "team 'search'" or "key 'alice'"."""
    reset = budgets.resets_at(b.period_kind, now)
    return QuotaRefused("budget", f"budget exhausted: {owner} has used or reserved {_amount(committed, b.unit)} "
                                  f"of its {_ADJECTIVE[b.period_kind]} budget of {_amount(b.amount, b.unit)} ({b.unit}) for "
                                  f"{b.period}; this request needs up to {_amount(b.cost, b.unit)}; the budget "
                                  f"resets at {reset.isoformat()}", max(1000, int((reset.timestamp() - now) * 1000)))


def admit(session: Session, *, lease_id: str, caller: str, day: str, router_id: str, tokens: int, quota: int,
          max_concurrent: int, now: float | None = None) -> None:
    """Take a lease for one request, or raise QuotaRefused."""
    result = admit_many(session, [LeaseRequest(lease_id, caller, tokens, quota, max_concurrent)], day=day,
                        router_id=router_id, now=now)[0]
    if isinstance(result, QuotaRefused):
        raise result


def settle_many(session: Session, used: Sequence[tuple]) -> None:
    """End leases (lease id, tokens the request really used[, what it cost in its team budget's unit[, in its key
    budget's unit]]) and count those tokens on each lease's day, the costs on its budget periods, and give back
    the token-rate reservation it did not use (idempotent: a lease already gone is skipped). Rows are locked in
    admit_many's order: callers, keys' spend, teams' spend."""
    leases = {lease.lease_id: lease for lease in
              session.scalars(select(InflightLease).where(InflightLease.lease_id.in_([u[0] for u in used])))}
    totals: dict[tuple[str, str], int] = {}
    unused: dict[str, list[tuple[int, int]]] = {}
    spend: dict[tuple[str, str], float] = {}
    key_spend: dict[tuple[str, str], float] = {}
    for lease_id, actual, *cost in used:
        lease = leases.get(lease_id)
        if lease is None:
            continue
        key = (lease.caller, lease.day)
        totals[key] = totals.get(key, 0) + actual
        if lease.tpm_minute:
            unused.setdefault(lease.caller, []).append((int(lease.tpm_minute), int(lease.reserved_tokens) - actual))
        if lease.budget_period:
            spend[lease.team, lease.budget_period] = spend.get((lease.team, lease.budget_period), 0.0) + (
                cost[0] if cost else 0.0)
        if lease.key_budget_period:
            key_spend[lease.caller, lease.key_budget_period] = key_spend.get(
                (lease.caller, lease.key_budget_period), 0.0) + (cost[1] if len(cost) > 1 else 0.0)
    for caller, day in sorted(totals):
        _lock_usage_row(session, caller, day)
        session.execute(update(QuotaUsage).where(QuotaUsage.caller == caller, QuotaUsage.day == day)
                        .values(used_tokens=QuotaUsage.used_tokens + totals[caller, day]))
        for minute, tokens in unused.get(caller, ()):
            rate_limits.give_back(rate_limits.row_for(session, caller), minute, tokens)
    for (caller, period), amount in sorted(key_spend.items()):
        budgets.add_spend(session, caller, period, amount, budgets.KEY)
    for (team, period), amount in sorted(spend.items()):
        budgets.add_spend(session, team, period, amount)
    if leases:
        session.execute(delete(InflightLease).where(InflightLease.lease_id.in_(list(leases))))


def settle(session: Session, lease_id: str, actual_tokens: int) -> None:
    """End one lease and count the tokens the request really used on the lease's day (idempotent)."""
    settle_many(session, [(lease_id, actual_tokens)])


def renew(session: Session, router_id: str, now: float | None = None) -> None:
    """Keep this router's leases alive; drop everyone's leases that lapsed long ago."""
    now = time.time() if now is None else now
    session.execute(update(InflightLease).where(InflightLease.router_id == router_id)
                    .values(expires_at=now + LEASE_TTL_S))
    session.execute(delete(InflightLease).where(InflightLease.expires_at < now - LEASE_TTL_S))


def usage(session: Session, caller: str, day: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    used = session.scalar(select(QuotaUsage.used_tokens).where(QuotaUsage.caller == caller, QuotaUsage.day == day))
    inflight, reserved = _live(session, caller, day, now)
    return {"day": day, "used": int(used or 0), "reserved": reserved, "inflight": inflight}
