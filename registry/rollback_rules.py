"""Automatic rollback rules: "if version V of model M has an error rate above E or a TTFT p95 above T for
N consecutive minutes, route it to 0 %". Operators arm and disarm them through the admin API (audited);
usage/auto_rollback.py evaluates the armed ones and fires them (audited as actor `auto-rollback`)."""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version, get_model_version
from registry.schema import RollbackRule, utcnow

MINUTES_RANGE = (1, 120)
TTFT_RANGE_MS = (1.0, 600_000.0)
RULE_FIELDS = ("max_error_rate", "max_ttft_ms_p95", "minutes", "armed")


def rule_problems(max_error_rate: float | None, max_ttft_ms_p95: float | None, minutes: int) -> dict[str, str]:
    """Field -> why it is refused (empty = valid). At least one threshold is needed."""
    problems: dict[str, str] = {}
    if max_error_rate is None and max_ttft_ms_p95 is None:
        problems["max_error_rate"] = "set max_error_rate (0..1) or max_ttft_ms_p95 (ms), or both"
    if max_error_rate is not None and not 0 <= max_error_rate < 1:
        problems["max_error_rate"] = f"max_error_rate is {max_error_rate}; allowed 0 <= rate < 1 (0.05 = 5 %)"
    if max_ttft_ms_p95 is not None and not TTFT_RANGE_MS[0] <= max_ttft_ms_p95 <= TTFT_RANGE_MS[1]:
        problems["max_ttft_ms_p95"] = (f"max_ttft_ms_p95 is {max_ttft_ms_p95}; allowed "
                                       f"{TTFT_RANGE_MS[0]:.0f}..{TTFT_RANGE_MS[1]:.0f} ms")
    if not MINUTES_RANGE[0] <= minutes <= MINUTES_RANGE[1]:
        problems["minutes"] = f"minutes is {minutes}; allowed {MINUTES_RANGE[0]}..{MINUTES_RANGE[1]}"
    return problems


def rule_dict(rule: RollbackRule) -> dict:
    return {"id": rule.id, "model": rule.model, "version": rule.version, "max_error_rate": rule.max_error_rate,
            "max_ttft_ms_p95": rule.max_ttft_ms_p95, "minutes": rule.minutes, "armed": rule.armed,
            "armed_by": rule.armed_by, "armed_at": rule.armed_at.isoformat() if rule.armed_at else None,
            "fired_at": rule.fired_at.isoformat() if rule.fired_at else None, "fired_reason": rule.fired_reason}


def list_rules(session: Session, armed_only: bool = False) -> list[RollbackRule]:
    query = select(RollbackRule).order_by(RollbackRule.model, RollbackRule.version)
    if armed_only:
        query = query.where(RollbackRule.armed.is_(True))
    return list(session.scalars(query))


def get_rule(session: Session, model: str, version: str) -> RollbackRule | None:
    return session.scalar(select(RollbackRule).where(RollbackRule.model == model, RollbackRule.version == version))


def set_rule(session: Session, model: str, version: str, max_error_rate: float | None, max_ttft_ms_p95: float | None,
             minutes: int, armed: bool, actor: str) -> dict:
    """Create or change the rule of a known model version (audited only when something changes)."""
    problems = rule_problems(max_error_rate, max_ttft_ms_p95, minutes)
    if problems:
        raise RegistryError("; ".join(problems.values()))
    if get_model_version(session, model, version) is None:
        raise RegistryError(f"model {model!r} has no version {version!r}")
    row = get_rule(session, model, version)
    after = {"max_error_rate": max_error_rate, "max_ttft_ms_p95": max_ttft_ms_p95, "minutes": int(minutes),
             "armed": bool(armed)}
    before = {f: getattr(row, f) for f in RULE_FIELDS} if row is not None else None
    if before == after:
        return {**rule_dict(row), "changed": False}
    if row is None:
        row = RollbackRule(model=model, version=version, fired_reason="", **after)
        session.add(row)
    else:
        for key, value in after.items():
            setattr(row, key, value)
    if armed:  # (re-)arming starts a fresh watch
        row.armed_by, row.armed_at, row.fired_at, row.fired_reason = actor, utcnow(), None, ""
    audit(session, actor, "set_rollback_rule", f"{model}/{version}", before, after)
    bump_version(session)
    session.flush()
    return {**rule_dict(row), "changed": True}


def mark_fired(rule: RollbackRule, reason: str) -> None:
    """Disarm a rule that fired (the route change itself is audited by set_routes as `auto_rollback`)."""
    rule.armed, rule.fired_at, rule.fired_reason = False, utcnow(), reason
