"""Team budgets: a monthly amount per team in the platform currency, written only through the admin API
(audited) and read by the admin UI's chargeback page to compare actual and forecast cost."""
from __future__ import annotations

import math

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version
from registry.schema import Team, TeamBudget, utcnow

MAX_MONTHLY_AMOUNT = 1e12  # a bound, so a typo cannot store an absurd number


def budget_problem(monthly_amount: float) -> str | None:
    """Why an amount is refused (None = fine)."""
    if not isinstance(monthly_amount, (int, float)) or not math.isfinite(monthly_amount):
        return f"monthly_amount must be a finite number; got {monthly_amount!r}"
    if not 0 <= monthly_amount <= MAX_MONTHLY_AMOUNT:
        return f"monthly_amount is {monthly_amount}; allowed 0..{MAX_MONTHLY_AMOUNT:.0f}"
    return None


def list_budgets(session: Session) -> list[TeamBudget]:
    return list(session.scalars(select(TeamBudget).order_by(TeamBudget.team)))


def set_budget(session: Session, team: str, monthly_amount: float, currency: str, actor: str) -> dict:
    """Create or change a team's monthly budget. Refuses unknown teams and bad amounts (RegistryError);
    writes an audit row only when something changes. Returns the stored values and whether they changed."""
    problem = budget_problem(monthly_amount)
    if problem:
        raise RegistryError(problem)
    if session.get(Team, team) is None:
        known = sorted(session.scalars(select(Team.name)))
        raise RegistryError(f"team {team!r} is not registered; known teams: {known}")
    row = session.get(TeamBudget, team)
    before = {"monthly_amount": row.monthly_amount, "currency": row.currency} if row is not None else None
    after = {"monthly_amount": round(float(monthly_amount), 6), "currency": currency}
    if before == after:
        return {"team": team, **after, "changed": False}
    if row is None:
        session.add(TeamBudget(team=team, updated_by=actor, **after))
    else:
        row.monthly_amount, row.currency, row.updated_at, row.updated_by = (after["monthly_amount"], currency,
                                                                             utcnow(), actor)
    audit(session, actor, "set_budget", team, before, after)
    bump_version(session)
    return {"team": team, **after, "changed": True}


def delete_budget(session: Session, team: str, actor: str) -> bool:
    """Remove a team's budget; False (and no audit row) when it had none."""
    row = session.get(TeamBudget, team)
    if row is None:
        return False
    audit(session, actor, "delete_budget", team, {"monthly_amount": row.monthly_amount, "currency": row.currency},
          None)
    session.delete(row)
    bump_version(session)
    return True
