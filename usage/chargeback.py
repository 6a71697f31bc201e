"""Chargeback queries over the usage store; every function returns a pandas DataFrame.

Used by `fleet usage report`, the admin UI's chargeback page and budgets. Everything here reads the hourly
rollups (`usage_rollups`, usage/rollups.py), never the raw events, so a month-to-date report scans
thousands of rows, not billions. Token kinds are metered apart:
- prefill tokens = prompt_tokens - cached_prompt_tokens (the prompt part the GPU computed),
- cached tokens  = cached_prompt_tokens (served from the prefix cache),
- decode tokens  = completion_tokens.
Prices come from the store's `prices` table (per model, per 1M tokens; '*' = fallback).
GPU-hours come from the store's `gpu_hours(day, model, version, gpu_hours)` table, filled by the fleet;
each (day, model, version)'s hours are split over teams in proportion to the token work they caused
on it (`WORK_WEIGHTS`); hours with no traffic at all are reported as team '(idle)'.

Dates: `since` is inclusive, `until` exclusive, both 'YYYY-MM-DD' (UTC days) or date objects; None = open.
Dimensions for group_by: caller, team, model, version, adapter, tier (= priority), region, day.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from usage import store

DIMENSIONS = {"caller": "caller", "team": "team", "model": "model", "version": "version",
              "adapter": "adapter", "tier": "priority", "region": "region", "day": "day"}
# GPU work per token kind, relative to one prefill token. Cached tokens cost no compute (a KV hit);
# decode is counted like prefill by default; tune when measured per engine.
WORK_WEIGHTS = {"prefill": 1.0, "cached": 0.0, "decode": 1.0}
IDLE_TEAM = "(idle)"

DateLike = str | dt.date | None

# Over the hourly rollups (usage/rollups.py), whose partial rows are always summed.
_TOKEN_SUMS = """
    sum(requests) AS requests,
    sum(errors) AS errors,
    sum(cancelled) AS cancelled,
    sum(prefill_tokens) AS prefill_tokens,
    sum(cached_tokens) AS cached_tokens,
    sum(decode_tokens) AS decode_tokens"""


def _group_cols(group_by: Sequence[str]) -> list[str]:
    unknown = [g for g in group_by if g not in DIMENSIONS]
    if unknown:
        raise ValueError(f"unknown dimension(s) {unknown}; choose from {sorted(DIMENSIONS)}")
    return list(dict.fromkeys(group_by))


def where_clause(since: DateLike, until: DateLike, filters: dict[str, str | None]) -> tuple[str, list]:
    """SQL WHERE text and parameters for a day range (`until` exclusive) and equality filters on dimensions."""
    clauses, params = ["TRUE"], []
    if since is not None:
        clauses.append("day >= CAST(? AS DATE)")
        params.append(str(since))
    if until is not None:
        clauses.append("day < CAST(? AS DATE)")
        params.append(str(until))
    for dim, value in filters.items():
        if value is not None:
            clauses.append(f"{DIMENSIONS[dim]} = ?")
            params.append(value)
    return " AND ".join(clauses), params


def _filters(filters: dict[str, str | None] | None, **named: str | None) -> dict[str, str | None]:
    merged = {**named, **(filters or {})}
    unknown = [k for k in merged if k not in DIMENSIONS]
    if unknown:
        raise ValueError(f"unknown filter(s) {unknown}; choose from {sorted(DIMENSIONS)}")
    return merged


def _select_dims(cols: list[str]) -> str:
    return ", ".join(f"{DIMENSIONS[c]} AS {c}" for c in cols)


def _tidy(df: pd.DataFrame) -> pd.DataFrame:
    """Counts as int64, money rounded to 1e-6, days as datetime.date (DuckDB hands DATE back as datetime64)."""
    for col in ("requests", "errors", "cancelled", "prefill_tokens", "cached_tokens", "decode_tokens"):
        if col in df:
            df[col] = df[col].fillna(0).astype("int64")
    for col in [c for c in df.columns if c.startswith("cost_")]:
        df[col] = df[col].astype(float).round(6)
    if "day" in df and pd.api.types.is_datetime64_any_dtype(df["day"]):
        df["day"] = df["day"].dt.date
    return df


def usage_summary(store_path: Path, since: DateLike = None, until: DateLike = None,
                  group_by: Sequence[str] = ("team", "model", "adapter", "tier", "day"),
                  team: str | None = None, caller: str | None = None, model: str | None = None,
                  filters: dict[str, str | None] | None = None) -> pd.DataFrame:
    """Requests, errors, cancelled, prefill/cached/decode tokens per group; `filters` = more equality filters
    on DIMENSIONS (e.g. {"tier": "batch", "adapter": ""})."""
    cols = _group_cols(group_by)
    where, params = where_clause(since, until, _filters(filters, team=team, caller=caller, model=model))
    dims = _select_dims(cols)
    sql = (f"SELECT {dims + ',' if dims else ''} {_TOKEN_SUMS} FROM usage_rollups WHERE {where}"
           + (f" GROUP BY ALL ORDER BY {', '.join(cols)}" if cols else ""))
    with store.connect(store_path, read_only=True) as con:
        df = con.execute(sql, params).df()
    if not cols and not df["requests"].fillna(0).iloc[0] > 0:
        df = df.iloc[0:0]
    return _tidy(df)


def tokens_by_team_day(store_path: Path, since: DateLike = None, until: DateLike = None,
                       team: str | None = None) -> pd.DataFrame:
    return usage_summary(store_path, since, until, group_by=("team", "day"), team=team)


def cost_table(store_path: Path, since: DateLike = None, until: DateLike = None,
               group_by: Sequence[str] = ("team", "model", "adapter"), team: str | None = None,
               caller: str | None = None, model: str | None = None,
               filters: dict[str, str | None] | None = None) -> pd.DataFrame:
    """usage_summary columns plus cost_prefill, cost_cached, cost_decode, cost_total, priced per model."""
    cols = _group_cols(group_by)
    inner = list(dict.fromkeys([*cols, "model"]))  # prices are per model: sum costs after pricing
    where, params = where_clause(since, until, _filters(filters, team=team, caller=caller, model=model))
    outer_dims = ", ".join(cols)
    sql = f"""
        WITH u AS (SELECT {_select_dims(inner)}, {_TOKEN_SUMS} FROM usage_rollups WHERE {where} GROUP BY ALL),
        priced AS (
            SELECT u.*,
                u.prefill_tokens * coalesce(p.prefill_per_m, d.prefill_per_m, 0) / 1e6 AS cost_prefill,
                u.cached_tokens * coalesce(p.cached_per_m, d.cached_per_m, 0) / 1e6 AS cost_cached,
                u.decode_tokens * coalesce(p.decode_per_m, d.decode_per_m, 0) / 1e6 AS cost_decode
            FROM u LEFT JOIN prices p ON p.model = u.model LEFT JOIN prices d ON d.model = '*')
        SELECT {outer_dims + ',' if cols else ''}
            sum(requests) AS requests, sum(errors) AS errors, sum(cancelled) AS cancelled,
            sum(prefill_tokens) AS prefill_tokens, sum(cached_tokens) AS cached_tokens,
            sum(decode_tokens) AS decode_tokens,
            sum(cost_prefill) AS cost_prefill, sum(cost_cached) AS cost_cached, sum(cost_decode) AS cost_decode,
            sum(cost_prefill + cost_cached + cost_decode) AS cost_total
        FROM priced {('GROUP BY ' + outer_dims + ' ORDER BY cost_total DESC, ' + outer_dims) if cols else ''}"""
    with store.connect(store_path, read_only=True) as con:
        df = con.execute(sql, params).df()
    df = df[df["requests"].notna() & (df["requests"] > 0)].reset_index(drop=True)
    return _tidy(df)


def top_callers(store_path: Path, since: DateLike = None, until: DateLike = None, n: int = 10,
                team: str | None = None) -> pd.DataFrame:
    """The n callers with the highest cost, with their team and token totals."""
    df = cost_table(store_path, since, until, group_by=("caller", "team"), team=team)
    return df.sort_values(["cost_total", "caller"], ascending=[False, True]).head(n).reset_index(drop=True)


def gpu_hours_by_team(store_path: Path, since: DateLike = None, until: DateLike = None, team: str | None = None,
                      by_day: bool = False, work_weights: dict[str, float] | None = None) -> pd.DataFrame:
    """GPU-hours allocated per team (and day): columns team, [day], gpu_hours, work_tokens, share,
    tokens_per_gpu_hour. Shares are computed over all teams, then filtered by `team`."""
    w = {**WORK_WEIGHTS, **(work_weights or {})}
    where, params = where_clause(since, until, {})
    gwhere, gparams = where_clause(since, until, {})
    sql = f"""
        WITH work AS (
            SELECT day, model, version, team,
                sum(prefill_tokens * {float(w['prefill'])}
                    + cached_tokens * {float(w['cached'])} + decode_tokens * {float(w['decode'])}) AS work
            FROM usage_rollups WHERE {where} GROUP BY ALL HAVING work > 0),
        total AS (SELECT day, model, version, sum(work) AS total FROM work GROUP BY ALL),
        g AS (SELECT * FROM gpu_hours WHERE {gwhere}),
        alloc AS (
            SELECT g.day, coalesce(work.team, '{IDLE_TEAM}') AS team, coalesce(work.work, 0) AS work_tokens,
                g.gpu_hours * coalesce(work.work / total.total, 1.0) AS gpu_hours
            FROM g LEFT JOIN work USING (day, model, version) LEFT JOIN total USING (day, model, version))
        SELECT team, {'day,' if by_day else ''} sum(gpu_hours) AS gpu_hours, sum(work_tokens) AS work_tokens
        FROM alloc GROUP BY ALL ORDER BY {'day, ' if by_day else ''}gpu_hours DESC, team"""
    with store.connect(store_path, read_only=True) as con:
        df = con.execute(sql, params + gparams).df()
    keys = ["day"] if by_day else []
    totals = df.groupby(keys)["gpu_hours"].transform("sum") if keys else df["gpu_hours"].sum()
    df["share"] = (df["gpu_hours"] / totals).fillna(0.0) if len(df) else []
    df["tokens_per_gpu_hour"] = (df["work_tokens"] / df["gpu_hours"].where(df["gpu_hours"] > 0)).fillna(0.0)
    df["work_tokens"] = df["work_tokens"].round(1)
    if team is not None:
        df = df[df["team"] == team]
    return _tidy(df.reset_index(drop=True))


def rejects_summary(store_path: Path) -> pd.DataFrame:
    """Dead-lettered events per reason (the loader's reject counter, durable)."""
    with store.connect(store_path, read_only=True) as con:
        return con.execute("SELECT reason, count(*) AS events, max(rejected_at) AS last_at FROM usage_rejects "
                           "GROUP BY reason ORDER BY events DESC").df()
