"""Usage-store reads for the chargeback page and the rollout comparison (DuckDB, read-only, per query).

Chargeback numbers come from `usage.chargeback` (one definition of prefill/cached/decode and of prices);
this module adds the few UI-only shapes: tokens in long form for stacked charts, hourly buckets, the list
of teams, and the per-version latency/error comparison used during a rollout.
"""
from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pandas as pd

from common.settings import load_settings
from usage import chargeback, store

TOKEN_KINDS = {"prefill_tokens": "prefill", "cached_tokens": "cached", "decode_tokens": "decode"}
COMPARISON_COLUMNS = ["model", "version", "requests", "errors", "error_rate", "ttft_ms_p50", "ttft_ms_p95",
                      "duration_ms_p95", "tokens_per_s_p50"]


def store_path(path: Path | None = None) -> Path:
    return Path(path) if path is not None else load_settings().usage_db_path


def _until_exclusive(until: dt.date | None) -> dt.date | None:
    """The page's date range is inclusive of its end day; chargeback's `until` is exclusive."""
    return until + dt.timedelta(days=1) if until is not None else None


def teams(path: Path | None = None) -> list[str]:
    """Teams that have usage in the store."""
    with store.connect(store_path(path), read_only=True) as con:
        return [r[0] for r in con.execute("SELECT DISTINCT team FROM usage_rollups ORDER BY team").fetchall()]


def date_bounds(path: Path | None = None) -> tuple[dt.date, dt.date] | None:
    """First and last UTC day with usage, or None for an empty store."""
    with store.connect(store_path(path), read_only=True) as con:
        lo, hi = con.execute("SELECT min(day), max(day) FROM usage_rollups").fetchone()
    return (lo, hi) if lo is not None else None


def tokens_over_time(since: dt.date | None, until: dt.date | None, team: str | None = None,
                     granularity: str = "day", path: Path | None = None) -> pd.DataFrame:
    """Long form: period, team, kind (prefill|cached|decode), tokens; `until` inclusive."""
    if granularity == "day":
        wide = chargeback.tokens_by_team_day(store_path(path), since, _until_exclusive(until), team=team)
        wide = wide.rename(columns={"day": "period"})
    elif granularity == "hour":
        wide = _tokens_by_team_hour(since, _until_exclusive(until), team, path)
    else:
        raise ValueError(f"granularity {granularity!r}: choose day or hour")
    if wide.empty:
        return pd.DataFrame(columns=["period", "team", "kind", "tokens"])
    long = wide.melt(id_vars=["period", "team"], value_vars=list(TOKEN_KINDS), var_name="kind", value_name="tokens")
    long["kind"] = long["kind"].map(TOKEN_KINDS)
    return long.sort_values(["period", "team", "kind"]).reset_index(drop=True)


def _tokens_by_team_hour(since: dt.date | None, until: dt.date | None, team: str | None,
                         path: Path | None) -> pd.DataFrame:
    where, params = chargeback.where_clause(since, until, {"team": team})
    sql = ("SELECT epoch_ms(CAST(hour * 1000 AS BIGINT)) AS period, team, "
           "sum(prefill_tokens) AS prefill_tokens, sum(cached_tokens) AS cached_tokens, "
           f"sum(decode_tokens) AS decode_tokens FROM usage_rollups WHERE {where} "
           "GROUP BY ALL ORDER BY period, team")
    with store.connect(store_path(path), read_only=True) as con:
        return con.execute(sql, params).df()


def cost_table(since: dt.date | None, until: dt.date | None, team: str | None = None,
               path: Path | None = None) -> pd.DataFrame:
    """Cost by team, model and adapter (prefill / cached / decode priced separately); `until` inclusive."""
    return chargeback.cost_table(store_path(path), since, _until_exclusive(until), team=team)


def top_callers(since: dt.date | None, until: dt.date | None, team: str | None = None, n: int = 10,
                path: Path | None = None) -> pd.DataFrame:
    return chargeback.top_callers(store_path(path), since, _until_exclusive(until), n=n, team=team)


def prices(path: Path | None = None) -> pd.DataFrame:
    """The prices used (per 1M tokens); model '*' is the fallback for models without their own row."""
    return store.list_prices(store_path(path))


def version_comparison(model: str, window_s: float = 3600.0, path: Path | None = None,
                       now: float | None = None) -> pd.DataFrame:
    """Per version of `model` over the last `window_s`: requests, error rate, TTFT p50/p95, duration p95
    and per-stream decode tokens/s (median) — the side-by-side view of a rollout."""
    since_ts = (now if now is not None else time.time()) - window_s
    sql = """
        SELECT model, version, count(*) AS requests,
               count(*) FILTER (WHERE status = 'error') AS errors,
               count(*) FILTER (WHERE status = 'error') / count(*) AS error_rate,
               quantile_cont(ttft_ms, 0.5) AS ttft_ms_p50,
               quantile_cont(ttft_ms, 0.95) AS ttft_ms_p95,
               quantile_cont(duration_ms, 0.95) AS duration_ms_p95,
               quantile_cont(CASE WHEN completion_tokens > 1 AND duration_ms > ttft_ms
                                  THEN (completion_tokens - 1) * 1000.0 / (duration_ms - ttft_ms) END, 0.5)
                   AS tokens_per_s_p50
        FROM usage_events WHERE model = ? AND ts >= ? AND day >= CAST(to_timestamp(?) AT TIME ZONE 'UTC' AS DATE) GROUP BY model, version ORDER BY version"""
    with store.connect(store_path(path), read_only=True) as con:
        frame = con.execute(sql, [model, since_ts, since_ts]).df()
    return frame[COMPARISON_COLUMNS]


def version_series(model: str, window_s: float, bucket_s: int, path: Path | None = None,
                   now: float | None = None) -> pd.DataFrame:
    """Per version of `model` and time bucket over the last `window_s`: requests, error rate, TTFT p95 and
    per-stream tokens/s (median) — the rollout's versions over time. Columns: bucket (UTC), version, ..."""
    since_ts = (now if now is not None else time.time()) - window_s
    sql = f"""
        SELECT to_timestamp(floor(ts / {int(bucket_s)}) * {int(bucket_s)}) AS bucket, version, count(*) AS requests,
               count(*) FILTER (WHERE status = 'error') / count(*) AS error_rate,
               quantile_cont(ttft_ms, 0.95) AS ttft_ms_p95,
               quantile_cont(CASE WHEN completion_tokens > 1 AND duration_ms > ttft_ms
                                  THEN (completion_tokens - 1) * 1000.0 / (duration_ms - ttft_ms) END, 0.5)
                   AS tokens_per_s_p50
        FROM usage_events WHERE model = ? AND ts >= ? AND day >= CAST(to_timestamp(?) AT TIME ZONE 'UTC' AS DATE) GROUP BY ALL ORDER BY bucket, version"""
    with store.connect(store_path(path), read_only=True) as con:
        return con.execute(sql, [model, since_ts, since_ts]).df()
