"""Shared per-key limits (requests/s, tokens/min) and per-team fair-queueing weights: written through the
admin API (audited), read by every router from its registry snapshot and enforced in the shared quota
transaction (registry/quotas.py, registry/rate_limits.py) and the admission queue (router_service/fair_queue.py)."""
from __future__ import annotations

import math

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version
from registry.schema import Caller, Team

MAX_REQUESTS_PER_S = 1e6
MAX_TOKENS_PER_MINUTE = 10**12
WEIGHT_RANGE = (0.01, 1000.0)


def list_teams(session: Session) -> list[Team]:
    return list(session.scalars(select(Team).order_by(Team.name)))


def set_caller_limits(session: Session, caller: str, *, requests_per_s: float, tokens_per_minute: int,
                      actor: str) -> dict:
    """A caller's shared limits (0 = none); requests_per_s below 1 is refused (the window is one second)."""
    if not math.isfinite(requests_per_s) or not (requests_per_s == 0 or 1 <= requests_per_s <= MAX_REQUESTS_PER_S):
        raise RegistryError(f"requests_per_s is {requests_per_s}; allowed 0 (no limit) or 1..{MAX_REQUESTS_PER_S:.0f}")
    if not 0 <= tokens_per_minute <= MAX_TOKENS_PER_MINUTE:
        raise RegistryError(f"tokens_per_minute is {tokens_per_minute}; allowed 0 (no limit) or "
                            f"1..{MAX_TOKENS_PER_MINUTE}")
    row = session.get(Caller, caller)
    if row is None:
        raise RegistryError(f"caller {caller!r} is not registered")
    before = {"requests_per_s": row.requests_per_s, "tokens_per_minute": row.tokens_per_minute}
    after = {"requests_per_s": float(requests_per_s), "tokens_per_minute": int(tokens_per_minute)}
    if before != after:
        row.requests_per_s, row.tokens_per_minute = after["requests_per_s"], after["tokens_per_minute"]
        audit(session, actor, "set_caller_limits", caller, before, after)
        bump_version(session)
    return {"caller": caller, **after, "changed": before != after}


def set_team_weight(session: Session, team: str, weight: float, actor: str) -> dict:
    """A team's fair-queueing weight: its share of a busy tier's tokens relative to other teams (default 1)."""
    if not math.isfinite(weight) or not WEIGHT_RANGE[0] <= weight <= WEIGHT_RANGE[1]:
        raise RegistryError(f"weight is {weight}; allowed {WEIGHT_RANGE[0]}..{WEIGHT_RANGE[1]}")
    row = session.get(Team, team)
    if row is None:
        raise RegistryError(f"team {team!r} is not registered")
    before, after = {"fair_weight": row.fair_weight}, {"fair_weight": float(weight)}
    if before != after:
        row.fair_weight = float(weight)
        audit(session, actor, "set_team_weight", team, before, after)
        bump_version(session)
    return {"team": team, **after, "changed": before != after}
