"""Daily token quotas and per-caller concurrency caps, kept in the registry database so that every router
shares them and a restart forgets nothing.

Each request in flight holds a lease row (`inflight_leases`): its token reservation (prompt + max_tokens)
and one concurrency slot. Admission runs in one transaction that first writes the caller's `quota_usage`
row: that write takes the row lock on PostgreSQL (the database write lock on SQLite), so admissions of one
caller are serialised across routers and the check "used + reserved + asked <= quota and leases < cap"
cannot be raced. Settling deletes the lease and adds what the request really used. A router renews its
leases every few seconds; one that dies stops renewing, and its leases lapse after `LEASE_TTL_S`.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from registry.schema import InflightLease, QuotaUsage

LEASE_TTL_S = 60.0


class QuotaRefused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message  # kind: "quota" or "concurrency"


def _lock_usage_row(session: Session, caller: str, day: str) -> int:
    """Create the caller-day row if missing and write-lock it; returns the tokens used so far."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(QuotaUsage).values(caller=caller, day=day, used_tokens=0).on_conflict_do_nothing())
    session.execute(update(QuotaUsage).where(QuotaUsage.caller == caller, QuotaUsage.day == day)
                    .values(used_tokens=QuotaUsage.used_tokens))
    return int(session.scalar(select(QuotaUsage.used_tokens).where(QuotaUsage.caller == caller,
                                                                   QuotaUsage.day == day)) or 0)


@dataclass(frozen=True)
class LeaseRequest:
    lease_id: str
    caller: str
    tokens: int            # reservation: prompt + max_tokens
    quota: int             # the caller's tokens per day
    max_concurrent: int    # 0 = no cap


def admit_many(session: Session, requests: Sequence[LeaseRequest], *, day: str, router_id: str,
               now: float | None = None) -> list[QuotaRefused | None]:
    """Take a lease for each request, in order, in the session's transaction: None where taken, the
    QuotaRefused where not (a refusal writes nothing of its own; the others in the batch still commit).
    Each caller's row is locked once and callers in name order, so batches never wait on each other in a
    cycle; a caller's later requests see its earlier ones' leases."""
    now = time.time() if now is None else now
    out: list[QuotaRefused | None] = [None] * len(requests)
    by_caller: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        by_caller.setdefault(r.caller, []).append(i)
    for caller in sorted(by_caller):
        used = _lock_usage_row(session, caller, day)
        live = (InflightLease.caller == caller, InflightLease.expires_at > now)
        count = session.scalar(select(func.count()).select_from(InflightLease).where(*live)) or 0
        reserved = int(session.scalar(select(func.coalesce(func.sum(InflightLease.reserved_tokens), 0))
                                      .where(*live, InflightLease.day == day)) or 0)
        for i in by_caller[caller]:
            r = requests[i]
            if r.max_concurrent and count >= r.max_concurrent:
                out[i] = QuotaRefused("concurrency", f"concurrency: caller {caller!r} has {count} requests in "
                                                     f"flight; its cap is {r.max_concurrent}")
            elif used + reserved + r.tokens > r.quota:
                out[i] = QuotaRefused("quota", f"token quota: caller {caller!r} has used {used + reserved} of "
                                               f"{r.quota} tokens today (UTC); this request needs up to {r.tokens} "
                                               f"(prompt + max_tokens)")
            else:
                count, reserved = count + 1, reserved + r.tokens
                session.add(InflightLease(lease_id=r.lease_id, caller=caller, day=day, router_id=router_id,
                                          reserved_tokens=r.tokens, expires_at=now + LEASE_TTL_S))
    return out


def admit(session: Session, *, lease_id: str, caller: str, day: str, router_id: str, tokens: int, quota: int,
          max_concurrent: int, now: float | None = None) -> None:
    """Take a lease for one request, or raise QuotaRefused."""
    refused = admit_many(session, [LeaseRequest(lease_id, caller, tokens, quota, max_concurrent)], day=day,
                         router_id=router_id, now=now)[0]
    if refused is not None:
        raise refused


def settle_many(session: Session, used: Sequence[tuple[str, int]]) -> None:
    """End leases (lease id, tokens the request really used) and count those tokens on each lease's day
    (idempotent: a lease already gone is skipped). Callers' rows are locked in name order, as admit_many."""
    leases = {lease.lease_id: lease for lease in
              session.scalars(select(InflightLease).where(InflightLease.lease_id.in_([lid for lid, _ in used])))}
    totals: dict[tuple[str, str], int] = {}
    for lease_id, actual in used:
        lease = leases.get(lease_id)
        if lease is not None:
            key = (lease.caller, lease.day)
            totals[key] = totals.get(key, 0) + actual
    for caller, day in sorted(totals):
        _lock_usage_row(session, caller, day)
        session.execute(update(QuotaUsage).where(QuotaUsage.caller == caller, QuotaUsage.day == day)
                        .values(used_tokens=QuotaUsage.used_tokens + totals[caller, day]))
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
    live = (InflightLease.caller == caller, InflightLease.expires_at > now)
    reserved = session.scalar(select(func.coalesce(func.sum(InflightLease.reserved_tokens), 0))
                              .where(*live, InflightLease.day == day))
    inflight = session.scalar(select(func.count()).select_from(InflightLease).where(*live))
    return {"day": day, "used": int(used or 0), "reserved": int(reserved or 0), "inflight": int(inflight or 0)}
