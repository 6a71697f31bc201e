"""SQLAlchemy 2 ORM tables of the registry (docs/architecture.md, Registry).

Changed only through an Alembic migration."""
from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

MODEL_STATUSES = ("building", "built", "staged", "serving", "draining", "retired", "failed")
TIERS = ("interactive", "standard", "batch")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class RegistryMeta(Base):
    """A single row whose `version` grows on every write: routers poll it to know when to reload."""
    __tablename__ = "registry_meta"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class ModelVersion(Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("name", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[str] = mapped_column(String(64))
    weights_uri: Mapped[str] = mapped_column(Text, default="")
    dtype: Mapped[str] = mapped_column(String(16), default="bf16")
    tensor_parallel: Mapped[int] = mapped_column(Integer, default=1)
    max_context: Mapped[int] = mapped_column(Integer, default=2048)
    engine_kind: Mapped[str] = mapped_column(String(32), default="cpu")
    status: Mapped[str] = mapped_column(String(16), default="building")
    status_reason: Mapped[str] = mapped_column(Text, default="")
    repository_path: Mapped[str] = mapped_column(Text, default="")
    build_info: Mapped[dict] = mapped_column(JSON, default=dict)
    # the build's quality-gate report (build_engines.quality_gate): passed, metrics, thresholds, eval-set sha256;
    # None for versions built before the gate existed. The rollout rule reads `passed` (router_service.rollout).
    quality_gate: Mapped[dict | None] = mapped_column(JSON, nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Route(Base):
    __tablename__ = "routes"
    __table_args__ = (UniqueConstraint("model", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[str] = mapped_column(String(64))
    percent: Mapped[int] = mapped_column(Integer)
    pools: Mapped[list] = mapped_column(JSON, default=list)


class Adapter(Base):
    __tablename__ = "adapters"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(128))
    base_version: Mapped[str] = mapped_column(String(64))
    uri: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer, default=8)
    owner_team: Mapped[str] = mapped_column(String(128), ForeignKey("teams.name"))
    status: Mapped[str] = mapped_column(String(16), default="ready")


class Team(Base):
    __tablename__ = "teams"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    cost_center: Mapped[str] = mapped_column(String(64), default="")
    fair_weight: Mapped[float] = mapped_column(Float, default=1.0)  # share of a busy tier's tokens (fair queueing)


class Caller(Base):
    __tablename__ = "callers"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    api_key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    team: Mapped[str] = mapped_column(String(128), ForeignKey("teams.name"))
    max_tier: Mapped[str] = mapped_column(String(16), default="interactive")
    token_quota_per_day: Mapped[int] = mapped_column(BigInteger, default=10_000_000)
    allowed_models: Mapped[list] = mapped_column(JSON, default=list)  # empty = all
    allowed_adapters: Mapped[list] = mapped_column(JSON, default=list)  # empty = those of its team
    region: Mapped[str] = mapped_column(String(32), default="local")
    canary_access: Mapped[bool] = mapped_column(Boolean, default=False)  # may pin 0 % (staged) versions
    max_concurrent: Mapped[int] = mapped_column(Integer, default=256)  # streams in flight, all routers (0 = no cap)
    requests_per_s: Mapped[float] = mapped_column(Float, default=0.0)  # shared by every router (0 = no limit)
    tokens_per_minute: Mapped[int] = mapped_column(BigInteger, default=0)  # prompt + max_tokens, all routers (0 = none)


class AdminToken(Base):
    """A named operator or viewer token; only its SHA-256 is stored (registry/admin_tokens.py)."""
    __tablename__ = "admin_tokens"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class QuotaUsage(Base):
    """Tokens a caller's finished requests used on one UTC day, shared by every router (registry/quotas.py)."""
    __tablename__ = "quota_usage"
    caller: Mapped[str] = mapped_column(String(128), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)
    used_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class InflightLease(Base):
    """One request in flight: holds its token reservation and a concurrency slot until settled or expired
    (a router that dies stops renewing its leases, so they lapse)."""
    __tablename__ = "inflight_leases"
    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    caller: Mapped[str] = mapped_column(String(128), index=True)
    day: Mapped[str] = mapped_column(String(10))
    router_id: Mapped[str] = mapped_column(String(128), index=True)
    reserved_tokens: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)  # unix seconds
    team: Mapped[str] = mapped_column(String(128), default="")
    budget_period: Mapped[str] = mapped_column(String(10), default="")  # '' = its team had no budget
    budget_reserved: Mapped[float] = mapped_column(Float, default=0.0)  # worst case in the budget's unit
    tpm_minute: Mapped[int] = mapped_column(BigInteger, default=0)  # unix minute its tokens were counted in
    key_budget_period: Mapped[str] = mapped_column(String(10), default="")  # '' = its key had no budget
    key_budget_reserved: Mapped[float] = mapped_column(Float, default=0.0)  # worst case in the key budget's unit


class CallerRate(Base):
    """Sliding-window counters of a caller's request rate (1 s windows) and token rate (1 min windows), shared by
    every router; written only under the caller's quota_usage row lock (registry/rate_limits.py)."""
    __tablename__ = "caller_rates"
    caller: Mapped[str] = mapped_column(String(128), primary_key=True)
    sec_start: Mapped[int] = mapped_column(BigInteger, default=0)
    sec_count: Mapped[int] = mapped_column(Integer, default=0)
    sec_prev: Mapped[int] = mapped_column(Integer, default=0)
    min_start: Mapped[int] = mapped_column(BigInteger, default=0)
    min_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    min_prev: Mapped[int] = mapped_column(BigInteger, default=0)


class BudgetSpend(Base):
    """What a team's settled requests cost in one budget period (money or tokens, the budget's unit), shared by
    every router; reservations of requests in flight are their leases' `budget_reserved`."""
    __tablename__ = "budget_spend"
    team: Mapped[str] = mapped_column(String(128), primary_key=True)
    period: Mapped[str] = mapped_column(String(10), primary_key=True)  # '2026-12' (month) or '2026-12-04' (day)
    spent: Mapped[float] = mapped_column(Float, default=0.0)


class KeyBudgetSpend(Base):
    """What one API key's settled requests cost in one budget period (its key budget's unit), shared by every
    router; reservations of its requests in flight are their leases' `key_budget_reserved`."""
    __tablename__ = "key_budget_spend"
    caller: Mapped[str] = mapped_column(String(128), primary_key=True)
    period: Mapped[str] = mapped_column(String(10), primary_key=True)
    spent: Mapped[float] = mapped_column(Float, default=0.0)


class WarmBuffer(Base):
    __tablename__ = "warm_buffers"
    __table_args__ = (UniqueConstraint("model", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    min_idle_replicas: Mapped[int] = mapped_column(Integer, default=0)
    min_replicas: Mapped[int] = mapped_column(Integer, default=1)
    max_replicas: Mapped[int] = mapped_column(Integer, default=1)
    slo_ttft_ms_p95: Mapped[int] = mapped_column(Integer, default=500)
    slo_tokens_per_s: Mapped[int] = mapped_column(Integer, default=40)


class Replica(Base):
    """A running (or starting/draining) Triton replica, written by the actuator that started it."""
    __tablename__ = "replicas"
    replica_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[str] = mapped_column(String(64))
    region: Mapped[str] = mapped_column(String(32), default="local")
    grpc_url: Mapped[str] = mapped_column(String(256))
    http_url: Mapped[str] = mapped_column(String(256))
    metrics_url: Mapped[str] = mapped_column(String(256), default="")
    state: Mapped[str] = mapped_column(String(16), default="starting")  # starting|serving|draining|cordoned|stopped
    pid: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AuditLog(Base):
    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    before: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class TeamBudget(Base):
    """A team's monthly budget in the platform currency (FLEET_CURRENCY), set by operators via the admin API."""
    __tablename__ = "team_budgets"
    team: Mapped[str] = mapped_column(String(128), ForeignKey("teams.name"), primary_key=True)
    monthly_amount: Mapped[float] = mapped_column(Float)  # the amount per `period` (named when periods were months)
    currency: Mapped[str] = mapped_column(String(8))
    period: Mapped[str] = mapped_column(String(8), default="month")  # month | day (UTC)
    unit: Mapped[str] = mapped_column(String(8), default="money")  # money (priced by chargeback's rates) | tokens
    soft_share: Mapped[float] = mapped_column(Float, default=0.8)  # warn callers from this share of the amount
    enforce: Mapped[bool] = mapped_column(Boolean, default=True)  # refuse new requests at 100 % (hard limit)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(128), default="")


class KeyBudget(Base):
    """One API key's budget (optional, besides its team's): the same fields and enforcement as TeamBudget."""
    __tablename__ = "key_budgets"
    caller: Mapped[str] = mapped_column(String(128), ForeignKey("callers.name", ondelete="CASCADE"), primary_key=True)
    monthly_amount: Mapped[float] = mapped_column(Float)  # the amount per `period`
    currency: Mapped[str] = mapped_column(String(8))
    period: Mapped[str] = mapped_column(String(8), default="month")
    unit: Mapped[str] = mapped_column(String(8), default="money")
    soft_share: Mapped[float] = mapped_column(Float, default=0.8)
    enforce: Mapped[bool] = mapped_column(Boolean, default=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(128), default="")


class RollbackRule(Base):
    """Roll `version` of `model` back to 0 % when its error rate or TTFT p95 stays above a threshold for
    `minutes` consecutive minutes; armed by an operator, evaluated by usage/auto_rollback.py."""
    __tablename__ = "rollback_rules"
    __table_args__ = (UniqueConstraint("model", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64))
    max_error_rate: Mapped[float | None] = mapped_column(Float, nullable=True)  # 0..1
    max_ttft_ms_p95: Mapped[float | None] = mapped_column(Float, nullable=True)
    minutes: Mapped[int] = mapped_column(Integer, default=5)
    armed: Mapped[bool] = mapped_column(Boolean, default=True)
    armed_by: Mapped[str] = mapped_column(String(128), default="")
    armed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    fired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    fired_reason: Mapped[str] = mapped_column(Text, default="")


class FairHead(Base):
    """One router's fair-queueing state for one admission queue (router_service/fair_sync.py): its virtual time,
    its first waiting finish tags per tier and what each team it has waiting has tagged there in all.
    Rewritten every ~20 ms while requests wait; `seq` grows on each write, and a row whose seq stops growing
    (a dead router) is ignored by the others after a TTL."""
    __tablename__ = "fair_heads"
    router_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    queue: Mapped[str] = mapped_column(String(256), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, default=0)
    vt: Mapped[float] = mapped_column(Float, default=0.0)
    heads: Mapped[dict] = mapped_column(JSON, default=dict)   # tier index (str) -> finish tag
    teams: Mapped[dict] = mapped_column(JSON, default=dict)   # team -> tokens / weight tagged in all
    updated_at: Mapped[float] = mapped_column(Float)          # unix seconds (old rows are deleted)
