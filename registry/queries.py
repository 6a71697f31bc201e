"""Registry reads and writes used by the router, build_engines, the autoscaler, the admin UI and `fleet`.

Every write bumps the registry version (routers poll it) and admin changes add an audit row.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from registry.schema import (
    TIERS, Adapter, AuditLog, Caller, ModelVersion, RegistryMeta, Replica, Route, Team, WarmBuffer,
)


ROUTABLE_STATUSES = ("staged", "serving", "draining")


class RegistryError(ValueError):
    """A write the registry refuses; the message names the field and what is allowed."""


def hash_api_key(api_key: str) -> str:
    # Keys are 32 random bytes, so a plain SHA-256 cannot be brute-forced; no salt needed.
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    return "fk-" + secrets.token_urlsafe(32)


def bump_version(session: Session) -> None:
    session.execute(update(RegistryMeta).where(RegistryMeta.id == 1).values(version=RegistryMeta.version + 1))


def registry_version(session: Session) -> int:
    return session.scalar(select(RegistryMeta.version).where(RegistryMeta.id == 1)) or 0


def audit(session: Session, actor: str, action: str, target: str, before: dict | None, after: dict | None) -> None:
    session.add(AuditLog(actor=actor, action=action, target=target, before=before, after=after))


# --- models and routes -------------------------------------------------------------------------

def get_model_version(session: Session, name: str, version: str) -> ModelVersion | None:
    return session.scalar(select(ModelVersion).where(ModelVersion.name == name, ModelVersion.version == version))


def list_model_versions(session: Session) -> list[ModelVersion]:
    return list(session.scalars(select(ModelVersion).order_by(ModelVersion.name, ModelVersion.version)))


def upsert(session: Session, row: Any, create: Callable[[], Any], fields: dict[str, Any]) -> Any:
    """Set `fields` on `row`, or add the row `create()` makes when `row` is None; returns the row."""
    if row is None:
        row = create()
        session.add(row)
    else:
        for key, value in fields.items():
            setattr(row, key, value)
    return row


def upsert_model_version(session: Session, name: str, version: str, **fields) -> ModelVersion:
    row = upsert(session, get_model_version(session, name, version),
                 lambda: ModelVersion(name=name, version=version, **fields), fields)
    bump_version(session)
    session.flush()
    return row


def set_model_status(session: Session, name: str, version: str, status: str, reason: str = "") -> None:
    row = get_model_version(session, name, version)
    if row is None:
        raise RegistryError(f"model {name!r} has no version {version!r}")
    row.status, row.status_reason = status, reason
    bump_version(session)


def routes_for(session: Session, model: str) -> dict[str, int]:
    rows = session.scalars(select(Route).where(Route.model == model))
    return {r.version: r.percent for r in rows if r.percent > 0}


def all_routes(session: Session) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in session.scalars(select(Route)):
        if r.percent > 0:
            out.setdefault(r.model, {})[r.version] = r.percent
    return out


def percent_problems(version: str, percent: int, known_versions: Iterable[str]) -> list[str]:
    """Problems with giving `version` `percent` of a model's traffic (empty = valid)."""
    known = sorted(set(known_versions))
    problems = []
    if version not in known:
        problems.append(f"no version {version!r}; known versions: {known}")
    if not 0 <= percent <= 100:
        problems.append(f"percent for version {version!r} is {percent}; allowed 0..100")
    return problems


def split_problems(split: dict[str, int], known_versions: Iterable[str]) -> list[str]:
    """Problems with a full percent split (empty = valid): the route rules, checked here for `set_routes`
    and by the admin UI before it sends a split."""
    known = list(known_versions)
    problems = [p for version, percent in split.items() for p in percent_problems(version, percent, known)]
    if sum(split.values()) != 100:
        problems.append(f"the percents sum to {sum(split.values())}; they must sum to 100")
    return problems


def set_routes(session: Session, model: str, split: dict[str, int], actor: str, action: str = "set_routes",
               note: dict | None = None) -> bool:
    """Replace a model's percent split; it must name known versions and sum to 100. Returns False (no write,
    no audit row) when the split is already in force; `note` adds context to the audit row's `after`."""
    problems = split_problems(split, (m.version for m in list_model_versions(session) if m.name == model))
    if problems:
        raise RegistryError(f"routes of {model!r}: " + "; ".join(problems))
    for version, percent in split.items():
        row = get_model_version(session, model, version)
        if percent > 0 and row.status not in ROUTABLE_STATUSES:
            raise RegistryError(f"version {version!r} of {model!r} is {row.status!r}; only {list(ROUTABLE_STATUSES)} "
                                f"versions can take traffic")
    before = routes_for(session, model)
    after = {v: p for v, p in split.items() if p}
    if before == after:
        return False
    for row in session.scalars(select(Route).where(Route.model == model)):
        session.delete(row)
    session.flush()
    for version, percent in split.items():
        if percent > 0:
            session.add(Route(model=model, version=version, percent=percent, pools=[]))
    audit(session, actor, action, model, {"routes": before}, {"routes": after, **(note or {})})
    bump_version(session)
    return True


# --- teams, callers, adapters --------------------------------------------------------------------

def ensure_team(session: Session, name: str) -> Team:
    team = session.get(Team, name)
    if team is None:
        team = Team(name=name)
        session.add(team)
        session.flush()
    return team


def create_caller(session: Session, name: str, team: str, *, max_tier: str = "interactive",
                  token_quota_per_day: int = 10_000_000, api_key: str | None = None, max_concurrent: int = 256,
                  canary_access: bool = False) -> str:
    """Create (or re-key) a caller and return its plaintext API key; only the hash is stored."""
    if max_tier not in TIERS:
        raise RegistryError(f"max_tier {max_tier!r} is not one of {list(TIERS)}")
    if max_concurrent < 0:
        raise RegistryError(f"max_concurrent is {max_concurrent}; allowed: 0 (no cap) or more")
    ensure_team(session, team)
    api_key = api_key or new_api_key()
    caller = session.get(Caller, name)
    if caller is None:
        session.add(Caller(name=name, team=team, api_key_hash=hash_api_key(api_key), max_tier=max_tier,
                           token_quota_per_day=token_quota_per_day, allowed_models=[], allowed_adapters=[],
                           max_concurrent=max_concurrent, canary_access=canary_access))
    else:
        caller.api_key_hash, caller.team, caller.max_tier = hash_api_key(api_key), team, max_tier
        caller.max_concurrent, caller.canary_access = max_concurrent, canary_access
    bump_version(session)
    return api_key


def caller_by_key(session: Session, api_key: str) -> Caller | None:
    return session.scalar(select(Caller).where(Caller.api_key_hash == hash_api_key(api_key)))


def list_callers(session: Session) -> list[Caller]:
    return list(session.scalars(select(Caller)))


def list_adapters(session: Session) -> list[Adapter]:
    return list(session.scalars(select(Adapter)))


def upsert_adapter(session: Session, name: str, base_model: str, base_version: str, uri: str, rank: int,
                   owner_team: str) -> Adapter:
    ensure_team(session, owner_team)
    row = session.get(Adapter, name)
    if row is None:
        row = Adapter(name=name)
        session.add(row)
    row.base_model, row.base_version, row.uri, row.rank, row.owner_team = base_model, base_version, uri, rank, owner_team
    row.status = "ready"
    bump_version(session)
    return row


# --- replicas ----------------------------------------------------------------------------------------

def upsert_replica(session: Session, replica_id: str, **fields) -> Replica:
    row = upsert(session, session.get(Replica, replica_id), lambda: Replica(replica_id=replica_id, **fields), fields)
    bump_version(session)
    return row


def list_replicas(session: Session, model: str | None = None) -> list[Replica]:
    stmt = select(Replica).order_by(Replica.replica_id)
    if model is not None:
        stmt = stmt.where(Replica.model == model)
    return list(session.scalars(stmt))


def delete_replica(session: Session, replica_id: str) -> None:
    row = session.get(Replica, replica_id)
    if row is not None:
        session.delete(row)
        bump_version(session)


def list_warm_buffers(session: Session) -> list[WarmBuffer]:
    return list(session.scalars(select(WarmBuffer)))


def list_audit(session: Session, limit: int = 100) -> list[AuditLog]:
    return list(session.scalars(select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)))


@dataclass(frozen=True)
class ModelSummary:
    name: str
    version: str
    status: str
    max_context: int
    percent: int


def model_summaries(session: Session) -> list[ModelSummary]:
    routes = all_routes(session)
    return [ModelSummary(m.name, m.version, m.status, m.max_context, routes.get(m.name, {}).get(m.version, 0))
            for m in list_model_versions(session)]


# --- rollout operations (admin API) ------------------------------------------------------------------

def rollout_split(current: dict[str, int], version: str, percent: int) -> dict[str, int]:
    """The split after giving `version` `percent`: the other routed versions share the rest in proportion."""
    if not 0 <= percent <= 100:
        raise RegistryError(f"percent is {percent}; allowed 0..100")
    others = {v: p for v, p in current.items() if v != version and p > 0}
    rest = 100 - percent
    if rest and not others:
        raise RegistryError(f"no other routed version can take the remaining {rest} %; "
                            f"send percent=100 or a full split")
    total = sum(others.values()) or 1
    split = {v: rest * p // total for v, p in others.items()}
    if others:  # rounding leftovers go to the largest other version so the split sums to 100
        split[max(others, key=others.get)] += rest - sum(split.values())
    split[version] = percent
    return {v: p for v, p in split.items() if p > 0}


def rollback_routes(session: Session, model: str, actor: str) -> dict[str, int]:
    """Restore the split in force before the last route change of `model` (a second rollback undoes the first)."""
    last = session.scalar(select(AuditLog).where(AuditLog.target == model, AuditLog.action.in_(
        ("set_routes", "rollback", "auto_rollback"))).order_by(AuditLog.id.desc()).limit(1))
    if last is None or not (last.before or {}).get("routes"):
        raise RegistryError(f"model {model!r} has no earlier route to roll back to")
    previous = {v: int(p) for v, p in last.before["routes"].items()}
    set_routes(session, model, previous, actor, action="rollback")
    return previous


def set_replica_state(session: Session, replica_id: str, state: str, actor: str) -> None:
    allowed = ("serving", "draining", "cordoned")
    if state not in allowed:
        raise RegistryError(f"state {state!r} is not one of {list(allowed)}")
    row = session.get(Replica, replica_id)
    if row is None:
        raise RegistryError(f"replica {replica_id!r} is not registered")
    if row.state == state:
        return  # nothing changes: no audit row
    audit(session, actor, f"replica_{state}", replica_id, {"state": row.state}, {"state": state})
    row.state = state
    bump_version(session)
