"""Automatic rollback: evaluate the armed rules of registry/rollback_rules.py against the usage store and
route a misbehaving version to 0 % (the other routed versions take its share).

A rule fires when, in each of its last `minutes` whole UTC minutes, the version served requests and either
its error rate exceeded `max_error_rate` or its TTFT p95 exceeded `max_ttft_ms_p95`. A minute without
requests breaks the run, so a quiet version is never rolled back on old evidence. Firing writes the new
split through registry.queries.set_routes (audited as action `auto_rollback`, actor `auto-rollback`, with
the per-minute numbers), disarms the rule and bumps the registry version, so routers switch within a second.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pandas as pd

from registry import queries, rollback_rules
from registry.db import session_scope
from registry.schema import RollbackRule
from usage import store

log = logging.getLogger(__name__)
ACTOR = "auto-rollback"


def minute_stats(store_path: Path, model: str, version: str, minutes: int, now: float) -> pd.DataFrame:
    """The last `minutes` whole minutes before `now` for one version: minute (epoch s), requests, errors,
    error_rate, ttft_ms_p95. Minutes without requests are present with requests = 0."""
    end = math.floor(now / 60) * 60
    start = end - minutes * 60
    sql = """SELECT CAST(floor(ts / 60) * 60 AS BIGINT) AS minute, count(*) AS requests,
                    count(*) FILTER (WHERE status = 'error') AS errors, quantile_cont(ttft_ms, 0.95) AS ttft_ms_p95
             FROM usage_events WHERE model = ? AND version = ? AND ts >= ? AND ts < ?
               AND day >= CAST(to_timestamp(?) AT TIME ZONE 'UTC' AS DATE) GROUP BY ALL"""
    with store.connect(store_path, read_only=True) as con:
        got = con.execute(sql, [model, version, float(start), float(end), float(start)]).df().set_index("minute")
    frame = pd.DataFrame(index=pd.Index(range(start, end, 60), name="minute"))
    frame = frame.join(got).fillna({"requests": 0, "errors": 0}).reset_index()
    frame["error_rate"] = (frame["errors"] / frame["requests"].where(frame["requests"] > 0)).astype(float)
    return frame


def breach_reason(rule: RollbackRule, stats: pd.DataFrame) -> str | None:
    """Why the rule fires on these minutes, or None when it does not."""
    if len(stats) < rule.minutes or (stats["requests"] <= 0).any():
        return None
    err_limit = rule.max_error_rate if rule.max_error_rate is not None else math.inf
    ttft_limit = rule.max_ttft_ms_p95 if rule.max_ttft_ms_p95 is not None else math.inf
    if not ((stats["error_rate"] > err_limit) | (stats["ttft_ms_p95"] > ttft_limit)).all():
        return None
    first = pd.to_datetime(stats["minute"].min(), unit="s", utc=True)
    parts = [f"v{rule.version} of {rule.model} over the {rule.minutes} min from {first:%H:%M} UTC:",
             "error rate " + ", ".join(f"{e:.1%}" for e in stats["error_rate"])
             + (f" (limit {rule.max_error_rate:.1%})" if rule.max_error_rate is not None else ""),
             "TTFT p95 " + ", ".join(f"{t:.0f} ms" for t in stats["ttft_ms_p95"])
             + (f" (limit {rule.max_ttft_ms_p95:.0f} ms)" if rule.max_ttft_ms_p95 is not None else ""),
             "requests " + ", ".join(str(int(n)) for n in stats["requests"])]
    return "; ".join(parts)


def evaluate(store_path: Path, db_url: str, now: float | None = None) -> list[str]:
    """Check every armed rule once; fire those that breach. Returns one line per rule fired."""
    now = now if now is not None else time.time()
    fired = []
    with session_scope(db_url) as s:
        rules = [(r.id, r.model, r.version, r.minutes) for r in rollback_rules.list_rules(s, armed_only=True)]
    for rule_id, model, version, minutes in rules:
        stats = minute_stats(store_path, model, version, minutes, now)
        with session_scope(db_url) as s:
            rule = s.get(RollbackRule, rule_id)
            if rule is None or not rule.armed:
                continue
            reason = breach_reason(rule, stats)
            if reason is None:
                continue
            current = queries.routes_for(s, model)
            if current.get(version, 0) == 0:
                rollback_rules.mark_fired(rule, f"{reason}; the version already had no traffic")
                fired.append(f"{model} v{version}: already at 0 %, rule disarmed")
                continue
            try:
                split = queries.rollout_split(current, version, 0)
            except queries.RegistryError as exc:
                log.warning("rule %s/%s breaches but cannot roll back: %s", model, version, exc)
                continue
            queries.set_routes(s, model, split, actor=ACTOR, action="auto_rollback",
                               note={"version": version, "rule_id": rule_id, "reason": reason})
            rollback_rules.mark_fired(rule, reason)
            fired.append(f"{model}: {current} -> {split} ({reason})")
    return fired
