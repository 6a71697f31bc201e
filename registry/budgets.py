"""Team budgets: an amount per period (UTC month or day) in the platform currency (priced by chargeback's rates)
or in tokens, written only through the admin API (audited). Routers enforce them at admission
(registry/quotas.py reserves each request's worst case against `budget_spend` + live reservations); the admin
UI's chargeback page compares them with actual and forecast cost and shows the routers' spend."""
from __future__ import annotations

import datetime as dt
import math
import time

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version
from registry.schema import BudgetSpend, InflightLease, Team, TeamBudget, utcnow

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


def lock_spend(session: Session, team: str, period: str) -> float:
    """Create the team-period spend row if missing and write-lock it; returns what was spent so far."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(BudgetSpend).values(team=team, period=period, spent=0.0).on_conflict_do_nothing())
    where = (BudgetSpend.team == team, BudgetSpend.period == period)
    session.execute(update(BudgetSpend).where(*where).values(spent=BudgetSpend.spent))
    return float(session.scalar(select(BudgetSpend.spent).where(*where)) or 0.0)


def add_spend(session: Session, team: str, period: str, amount: float) -> None:
    lock_spend(session, team, period)
    session.execute(update(BudgetSpend).where(BudgetSpend.team == team, BudgetSpend.period == period)
                    .values(spent=BudgetSpend.spent + amount))


def reserved(session: Session, team: str, period: str, now: float | None = None) -> float:
    """Worst case of the team's requests in flight (live leases) in this period."""
    now = time.time() if now is None else now
    return float(session.scalar(select(func.coalesce(func.sum(InflightLease.budget_reserved), 0.0)).where(
        InflightLease.team == team, InflightLease.budget_period == period, InflightLease.expires_at > now)) or 0.0)


def spend_rows(session: Session, period_keys: dict[str, str] | None = None) -> dict[str, dict]:
    """team -> {current_period, spent, reserved} of each budgeted team's current period (the routers' numbers)."""
    out = {}
    for b in list_budgets(session):
        key = (period_keys or {}).get(b.team) or period_key(b.period)
        spent = session.scalar(select(BudgetSpend.spent).where(BudgetSpend.team == b.team, BudgetSpend.period == key))
        out[b.team] = {"current_period": key, "spent": float(spent or 0.0), "reserved": reserved(session, b.team, key)}
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


def list_budgets(session: Session) -> list[TeamBudget]:
    return list(session.scalars(select(TeamBudget).order_by(TeamBudget.team)))


def budget_dict(row: TeamBudget) -> dict:
    return {"monthly_amount": row.monthly_amount, "currency": row.currency, "period": row.period or "month",
            "unit": row.unit or "money", "soft_share": row.soft_share, "enforce": bool(row.enforce)}


def set_budget(session: Session, team: str, monthly_amount: float, currency: str, actor: str, *,
               period: str = "month", unit: str = "money", soft_share: float = 0.8, enforce: bool = True) -> dict:
    """Create or change a team's budget (`monthly_amount` per `period`, in `unit`). Refuses unknown teams and
    bad values (RegistryError); writes an audit row only when something changes. Returns the stored values and
    whether they changed."""
    problem = budget_problem(monthly_amount, period, unit, soft_share)
    if problem:
        raise RegistryError(problem)
    if session.get(Team, team) is None:
        known = sorted(session.scalars(select(Team.name)))
        raise RegistryError(f"team {team!r} is not registered; known teams: {known}")
    row = session.get(TeamBudget, team)
    before = budget_dict(row) if row is not None else None
    after = {"monthly_amount": round(float(monthly_amount), 6), "currency": currency, "period": period,
             "unit": unit, "soft_share": float(soft_share), "enforce": bool(enforce)}
    if before == after:
        return {"team": team, **after, "changed": False}
    if row is None:
        session.add(TeamBudget(team=team, updated_by=actor, **after))
    else:
        for k, v in after.items():
            setattr(row, k, v)
        row.updated_at, row.updated_by = utcnow(), actor
    audit(session, actor, "set_budget", team, before, after)
    bump_version(session)
    return {"team": team, **after, "changed": True}


def delete_budget(session: Session, team: str, actor: str) -> bool:
    """Remove a team's budget; False (and no audit row) when it had none."""
    row = session.get(TeamBudget, team)
    if row is None:
        return False
    audit(session, actor, "delete_budget", team, budget_dict(row), None)
    session.delete(row)
    bump_version(session)
    return True
