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


def admit(session: Session, *, lease_id: str, caller: str, day: str, router_id: str, tokens: int, quota: int,
          max_concurrent: int, now: float | None = None) -> None:
    """Take a lease for one request, or raise QuotaRefused (the session must then be rolled back)."""
    now = time.time() if now is None else now
    used = _lock_usage_row(session, caller, day)
    live = (InflightLease.caller == caller, InflightLease.expires_at > now)
    count = session.scalar(select(func.count()).select_from(InflightLease).where(*live)) or 0
    if max_concurrent and count >= max_concurrent:
        raise QuotaRefused("concurrency", f"concurrency: caller {caller!r} has {count} requests in flight; its cap "
                                          f"is {max_concurrent}")
    reserved = int(session.scalar(select(func.coalesce(func.sum(InflightLease.reserved_tokens), 0))
                                  .where(*live, InflightLease.day == day)) or 0)
    if used + reserved + tokens > quota:
        raise QuotaRefused("quota", f"token quota: caller {caller!r} has used {used + reserved} of {quota} tokens "
                                    f"today (UTC); this request needs up to {tokens} (prompt + max_tokens)")
    session.add(InflightLease(lease_id=lease_id, caller=caller, day=day, router_id=router_id,
                              reserved_tokens=tokens, expires_at=now + LEASE_TTL_S))


def settle(session: Session, lease_id: str, actual_tokens: int) -> None:
    """End a lease and count the tokens the request really used on the lease's day (idempotent)."""
    lease = session.get(InflightLease, lease_id)
    if lease is None:
        return
    _lock_usage_row(session, lease.caller, lease.day)
    session.execute(update(QuotaUsage).where(QuotaUsage.caller == lease.caller, QuotaUsage.day == lease.day)
                    .values(used_tokens=QuotaUsage.used_tokens + actual_tokens))
    session.delete(lease)


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
