"""The router's in-memory copy of the registry, reloaded whenever the registry version moves.

Reads are lock-free (a whole new snapshot replaces the old one), so the request path never
touches the database; a background task polls the version about every half second.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone

from registry import queries
from registry.admin_tokens import AdminIdentity, active_identities
from registry.budgets import KEY, list_budgets
from registry.caller_limits import list_teams
from registry.db import session_scope
from registry.warm_buffers import PoolSettings, managed_pools

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    status: str
    max_context: int
    weights_uri: str


@dataclass(frozen=True)
class CallerInfo:
    name: str
    team: str
    max_tier: str
    token_quota_per_day: int
    allowed_models: tuple[str, ...]
    allowed_adapters: tuple[str, ...]
    region: str
    canary_access: bool = False  # may pin versions that take no traffic (staged canaries)
    max_concurrent: int = 0  # streams in flight at once across every router (0 = no cap)
    requests_per_s: float = 0.0  # shared by every router (0 = no limit)
    tokens_per_minute: int = 0  # prompt + max_tokens per minute, shared by every router (0 = no limit)
    team_weight: float = 1.0  # the team's fair-queueing weight inside a tier
    budget: BudgetInfo | None = None  # the key's own budget (besides its team's), registry/budgets.py KEY


@dataclass(frozen=True)
class BudgetInfo:
    """A team's (or one key's) budget as routers enforce it (registry/budgets.py)."""
    team: str  # the owner: team name, or the caller's name for a key budget
    amount: float
    period: str  # month | day
    unit: str  # money | tokens
    soft_share: float
    enforce: bool


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    model: str
    version: str
    region: str
    grpc_url: str
    http_url: str
    state: str
    started_at: float = 0.0  # epoch seconds the row was written as starting (bounds how long it counts as starting)
    pid: int = 0  # changes when the actuator restarts the replica (lifts the router's own cordon)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    base_model: str
    owner_team: str
    base_version: str = ""
    status: str = "ready"


@dataclass
class Snapshot:
    version: int = 0
    models: dict[str, dict[str, ModelInfo]] = field(default_factory=dict)
    routes: dict[str, dict[str, int]] = field(default_factory=dict)
    callers_by_hash: dict[str, CallerInfo] = field(default_factory=dict)
    replicas: list[ReplicaInfo] = field(default_factory=list)
    adapters: dict[str, AdapterInfo] = field(default_factory=dict)
    pools: dict[tuple[str, str], PoolSettings] = field(default_factory=dict)  # (model, version) -> scaling settings
    admin_tokens: tuple[AdminIdentity, ...] = ()
    budgets: dict[str, BudgetInfo] = field(default_factory=dict)  # team -> budget


def load_snapshot(db_url: str) -> Snapshot:
    snap = Snapshot()
    with session_scope(db_url) as s:
        snap.version = queries.registry_version(s)
        for m in queries.list_model_versions(s):
            snap.models.setdefault(m.name, {})[m.version] = ModelInfo(m.name, m.version, m.status, m.max_context,
                                                                      m.weights_uri)
        snap.routes = queries.all_routes(s)
        weights = {t.name: float(t.fair_weight or 1.0) for t in list_teams(s)}
        key_budgets = {b.caller: _budget_info(b.caller, b) for b in list_budgets(s, KEY)}
        for c in queries.list_callers(s):
            snap.callers_by_hash[c.api_key_hash] = CallerInfo(
                c.name, c.team, c.max_tier, c.token_quota_per_day, tuple(c.allowed_models or ()),
                tuple(c.allowed_adapters or ()), c.region, bool(c.canary_access), int(c.max_concurrent or 0),
                float(c.requests_per_s or 0.0), int(c.tokens_per_minute or 0), weights.get(c.team, 1.0),
                key_budgets.get(c.name))
        snap.budgets = {b.team: _budget_info(b.team, b) for b in list_budgets(s)}
        snap.replicas = [ReplicaInfo(r.replica_id, r.model, r.version, r.region, r.grpc_url, r.http_url, r.state,
                                     _epoch(r.started_at), r.pid or 0) for r in queries.list_replicas(s)]
        snap.admin_tokens = active_identities(s)
        snap.adapters = {a.name: AdapterInfo(a.name, a.base_model, a.owner_team, a.base_version, a.status)
                         for a in queries.list_adapters(s)}
        snap.pools = {(p.model, p.version): p for p in managed_pools(s)}
    return snap


def _budget_info(owner: str, b) -> BudgetInfo:
    return BudgetInfo(owner, float(b.monthly_amount), b.period or "month", b.unit or "money",
                      float(b.soft_share if b.soft_share is not None else 0.8), bool(b.enforce))


def _epoch(at: datetime | None) -> float:
    if at is None:
        return 0.0
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()  # SQLite drops the zone


class RegistryCache:
    def __init__(self, db_url: str, poll_s: float = 0.5) -> None:
        self.db_url = db_url
        self.poll_s = poll_s
        self.snapshot = load_snapshot(db_url)

    def caller_for_key(self, api_key: str) -> CallerInfo | None:
        return self.snapshot.callers_by_hash.get(queries.hash_api_key(api_key))

    async def watch(self) -> None:
        """Reload on every registry version change; a failing database keeps the last good snapshot."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                current = await asyncio.to_thread(self._current_version)
                if current != self.snapshot.version:
                    self.snapshot = await asyncio.to_thread(load_snapshot, self.db_url)
                    log.info("registry reloaded at version %d", self.snapshot.version)
            except Exception as exc:  # the router keeps serving from its last snapshot
                log.warning("registry poll failed: %s", exc)

    def _current_version(self) -> int:
        with session_scope(self.db_url) as s:
            return queries.registry_version(s)
