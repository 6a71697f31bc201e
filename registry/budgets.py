"""Budgets: an amount per period (UTC month or day) in the platform currency (priced by chargeback's rates)
or in tokens, per team and optionally per API key, written only through the admin API (audited). Routers
enforce them at admission (registry/quotas.py reserves each request's worst case against the spend row + live
reservations, for its team's budget and its key's); the admin UI's chargeback page compares team budgets with
actual and forecast cost and shows the routers' spend.

A team's and a key's budget take the same path; `Scope` names the tables and lease columns of each."""
from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version
from registry.schema import BudgetSpend, Caller, InflightLease, KeyBudget, KeyBudgetSpend, Team, TeamBudget, utcnow


@dataclass(frozen=True)
class Scope:
    """Whose budget: the budget table, the spend table and the lease columns that hold reservations."""
    kind: str        # "team" | "key" (in messages and audit actions)
    budget: Any      # TeamBudget | KeyBudget (owner column `owner_attr`)
    spend: Any       # BudgetSpend | KeyBudgetSpend
    owner_attr: str  # "team" | "caller": the owner column in both tables
    lease_owner: Any
    lease_period: Any
    lease_reserved: Any
    owners: Any      # Team | Caller: an owner must be registered

    def spend_owner(self):
        return getattr(self.spend, self.owner_attr)


TEAM = Scope("team", TeamBudget, BudgetSpend, "team", InflightLease.team, InflightLease.budget_period,
             InflightLease.budget_reserved, Team)
KEY = Scope("key", KeyBudget, KeyBudgetSpend, "caller", InflightLease.caller, InflightLease.key_budget_period,
            InflightLease.key_budget_reserved, Caller)

MAX_MONTHLY_AMOUNT = 1e12  # a bound, so a typo cannot store an absurd number
PERIODS = ("month", "day")
UNITS = ("money", "tokens")


def period_key(period: str, now: float | None = None) -> str:
    """The budget period `now` falls in: '2026-12' (month) or '2026-12-04' (day), UTC."""
    day = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
    return day.isoformat()[:7] if period == "month" else day.isoformat()


def resets_at(period: str, now: float | None = None) -> dt.datetime:
    """When the period `now` falls in ends (UTC midnight, or the first of next month)."""
    day = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
    nxt = (day.replace(day=1) + dt.timedelta(days=32)).replace(day=1) if period == "month" else day + dt.timedelta(days=1)
    return dt.datetime.combine(nxt, dt.time(), dt.timezone.utc)


def lock_spend(session: Session, team: str, period: str, scope: Scope = TEAM) -> float:
    """Create the owner-period spend row if missing and write-lock it; returns what was spent so far."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    table = scope.spend
    session.execute(insert(table).values({scope.owner_attr: team, "period": period, "spent": 0.0})
                    .on_conflict_do_nothing())
    where = (scope.spend_owner() == team, table.period == period)
    session.execute(update(table).where(*where).values(spent=table.spent))
    return float(session.scalar(select(table.spent).where(*where)) or 0.0)


def add_spend(session: Session, team: str, period: str, amount: float, scope: Scope = TEAM) -> None:
    lock_spend(session, team, period, scope)
    session.execute(update(scope.spend).where(scope.spend_owner() == team, scope.spend.period == period)
                    .values(spent=scope.spend.spent + amount))


def reserved(session: Session, team: str, period: str, now: float | None = None, scope: Scope = TEAM) -> float:
    """Worst case of the owner's requests in flight (live leases) in this period."""
    now = time.time() if now is None else now
    return float(session.scalar(select(func.coalesce(func.sum(scope.lease_reserved), 0.0)).where(
        scope.lease_owner == team, scope.lease_period == period, InflightLease.expires_at > now)) or 0.0)


def spend_rows(session: Session, period_keys: dict[str, str] | None = None, scope: Scope = TEAM) -> dict[str, dict]:
    """owner -> {current_period, spent, reserved} of each budgeted team's (or key's) current period (the
    routers' numbers)."""
    out = {}
    for b in list_budgets(session, scope):
        owner = getattr(b, scope.owner_attr)
        key = (period_keys or {}).get(owner) or period_key(b.period)
        spent = session.scalar(select(scope.spend.spent).where(scope.spend_owner() == owner,
                                                               scope.spend.period == key))
        out[owner] = {"current_period": key, "spent": float(spent or 0.0),
                      "reserved": reserved(session, owner, key, scope=scope)}
    return out


def budget_problem(monthly_amount: float, period: str = "month", unit: str = "money",
                   soft_share: float = 0.8) -> str | None:
    """Why a budget is refused (None = fine)."""
    if not isinstance(monthly_amount, (int, float)) or not math.isfinite(monthly_amount):
        return f"monthly_amount must be a finite number; got {monthly_amount!r}"
    if not 0 <= monthly_amount <= MAX_MONTHLY_AMOUNT:
        return f"monthly_amount is {monthly_amount}; allowed 0..{MAX_MONTHLY_AMOUNT:.0f}"
    if period not in PERIODS:
        return f"period is {period!r}; allowed {list(PERIODS)}"
    if unit not in UNITS:
        return f"unit is {unit!r}; allowed {list(UNITS)}"
    if not isinstance(soft_share, (int, float)) or not 0 < soft_share <= 1:
        return f"soft_share is {soft_share!r}; allowed a share in (0, 1]"
    return None


def list_budgets(session: Session, scope: Scope = TEAM) -> list:
    return list(session.scalars(select(scope.budget).order_by(getattr(scope.budget, scope.owner_attr))))


def budget_dict(row: TeamBudget | KeyBudget) -> dict:
    return {"monthly_amount": row.monthly_amount, "currency": row.currency, "period": row.period or "month",
            "unit": row.unit or "money", "soft_share": row.soft_share, "enforce": bool(row.enforce)}


def set_budget(session: Session, team: str, monthly_amount: float, currency: str, actor: str, *,
               period: str = "month", unit: str = "money", soft_share: float = 0.8, enforce: bool = True,
               scope: Scope = TEAM) -> dict:
    """Create or change a team's (or, with scope=KEY, an API key's) budget (`monthly_amount` per `period`, in
    `unit`). Refuses unknown owners and bad values (RegistryError); writes an audit row only when something
    changes. Returns the stored values and whether they changed."""
    problem = budget_problem(monthly_amount, period, unit, soft_share)
    if problem:
        raise RegistryError(problem)
    if session.get(scope.owners, team) is None:
        if scope is TEAM:
            raise RegistryError(f"team {team!r} is not registered; known teams: {sorted(session.scalars(select(Team.name)))}")
        raise RegistryError(f"caller (API key) {team!r} is not registered")
    row = session.get(scope.budget, team)
    before = budget_dict(row) if row is not None else None
    after = {"monthly_amount": round(float(monthly_amount), 6), "currency": currency, "period": period,
             "unit": unit, "soft_share": float(soft_share), "enforce": bool(enforce)}
    owner = {scope.owner_attr: team}
    if before == after:
        return {**owner, **after, "changed": False}
    if row is None:
        session.add(scope.budget(updated_by=actor, **owner, **after))
    else:
        for k, v in after.items():
            setattr(row, k, v)
        row.updated_at, row.updated_by = utcnow(), actor
    audit(session, actor, _ACTION[scope.kind, "set"], team, before, after)
    bump_version(session)
    return {**owner, **after, "changed": True}


_ACTION = {("team", "set"): "set_budget", ("team", "delete"): "delete_budget",
           ("key", "set"): "set_key_budget", ("key", "delete"): "delete_key_budget"}


def delete_budget(session: Session, team: str, actor: str, scope: Scope = TEAM) -> bool:
    """Remove a team's (or key's) budget; False (and no audit row) when it had none."""
    row = session.get(scope.budget, team)
    if row is None:
        return False
    audit(session, actor, _ACTION[scope.kind, "delete"], team, budget_dict(row), None)
    session.delete(row)
    bump_version(session)
    return True
