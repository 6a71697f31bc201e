"""Router metrics over time: the `router_metrics` table of the usage store and the series the admin UI draws.

The metrics scraper (usage/metrics_scraper.py) stores every kept Prometheus sample of every router's
`/metrics` as (ts, name, labels, le, value) — counters and histogram buckets cumulative, as exposed. Rates
and quantiles are computed here from the differences between scrapes, the way Prometheus' `rate()` and
`histogram_quantile()` do: a counter that went down (router restart) counts from zero, an interval with no
new requests has no quantile, and a rate over an idle interval is 0.
"""
from __future__ import annotations

import json
import math
import time

import duckdb
import numpy as np
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from usage import store

TABLE_SQL = """CREATE TABLE IF NOT EXISTS router_metrics (
    ts DOUBLE NOT NULL, name VARCHAR NOT NULL, labels VARCHAR NOT NULL, le DOUBLE, value DOUBLE NOT NULL)"""
KEPT = {"fleet_router_requests_total", "fleet_router_completion_tokens_total", "fleet_router_shed_total",
        "fleet_router_ttft_seconds_bucket", "fleet_router_ttft_seconds_count",
        "fleet_router_queue_wait_seconds_bucket", "fleet_router_queue_wait_seconds_count",
        "fleet_router_queue_depth", "fleet_router_replica_kv_utilisation", "fleet_router_replica_waiting"}
SAMPLE_COLUMNS = ["ts", "name", "labels", "le", "value"]
SCRAPE_MARK = "scrape"  # the name of load()'s one-row-per-scrape marker


def parse_samples(text: str) -> list[tuple[str, str, float | None, float]]:
    """The kept samples of a Prometheus text page as (name, labels JSON, le or None, value)."""
    rows = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in KEPT:
                continue
            labels = dict(s.labels)
            le = labels.pop("le", None)
            rows.append((s.name, json.dumps(labels, sort_keys=True), float(le) if le is not None else None,
                         float(s.value)))
    return rows


# Gauges of a replica's own state: every router relays the same replica report, so one copy is kept.
REPLICA_GAUGES = {"fleet_router_replica_kv_utilisation", "fleet_router_replica_waiting"}


def merge_routers(pages: list[list[tuple]]) -> list[tuple]:
    """One fleet-wide scrape from every router's samples (each `parse_samples` of one router, in router order):
    counters and histograms keep one series per router (label `router`: the index), so a router that restarts
    resets only its own series and rates and quantiles sum over routers; gauges of the router's own queue are
    summed; replica gauges are kept once (the first router that has the replica)."""
    out: list[tuple] = []
    summed: dict[tuple, float] = {}
    seen_replica: set[tuple] = set()
    for index, rows in enumerate(pages):
        for name, labels, le, value in rows:
            if name in REPLICA_GAUGES:
                if (name, labels) not in seen_replica:
                    seen_replica.add((name, labels))
                    out.append((name, labels, le, value))
            elif name == "fleet_router_queue_depth":
                summed[name, labels, le] = summed.get((name, labels, le), 0.0) + value
            else:
                tagged = json.dumps({**json.loads(labels), "router": str(index)}, sort_keys=True) if len(pages) > 1 \
                    else labels
                out.append((name, tagged, le, value))
    return out + [(name, labels, le, value) for (name, labels, le), value in summed.items()]


def record(con: duckdb.DuckDBPyConnection, ts: float, rows: list[tuple], retention_s: float | None = None) -> int:
    """Insert one scrape's rows; drop rows older than `retention_s` when given."""
    con.execute(TABLE_SQL)
    if rows:
        frame = pd.DataFrame([(ts, *r) for r in rows], columns=SAMPLE_COLUMNS)
        con.register("scrape", frame)
        try:
            con.execute("INSERT INTO router_metrics SELECT * FROM scrape")
        finally:
            con.unregister("scrape")
    if retention_s is not None:
        con.execute("DELETE FROM router_metrics WHERE ts < ?", [ts - retention_s])
    return len(rows)


def load(store_path, since_ts: float, until_ts: float, step_s: float, names: list[str]) -> pd.DataFrame:
    """Samples of `names` at (about) one scrape per `step_s`, from the last scrape before `since_ts` (so the
    first interval has a start) to `until_ts`, plus one SCRAPE_MARK row per scrape (a series missing from a
    scrape counts as 0 there). Empty when nothing was scraped yet."""
    name_list = ", ".join("?" for _ in names)
    sql = f"""
        WITH scrapes AS (SELECT DISTINCT ts FROM router_metrics WHERE ts <= ?),
        first AS (SELECT coalesce(max(ts), ?) AS ts FROM scrapes WHERE ts < ?),
        picks AS (SELECT max(s.ts) AS ts FROM scrapes s, first f WHERE s.ts >= f.ts
                  GROUP BY floor(s.ts / ?))
        SELECT m.ts, m.name, m.labels, m.le, m.value FROM router_metrics m JOIN picks USING (ts)
        WHERE m.name IN ({name_list})
        UNION ALL SELECT ts, '{SCRAPE_MARK}', '{{}}', NULL, 0 FROM picks
        ORDER BY ts"""
    try:
        with store.connect(store_path, read_only=True) as con:
            return con.execute(sql, [until_ts, since_ts, since_ts, max(step_s, 1e-3), *names]).df()
    except duckdb.CatalogException:  # the scraper has not created the table yet
        return pd.DataFrame(columns=SAMPLE_COLUMNS)


def _label(frame: pd.DataFrame, key: str) -> pd.Series:
    return frame["labels"].map(lambda s: json.loads(s).get(key, ""))


def _deltas(wide: pd.DataFrame) -> pd.DataFrame:
    """Per-interval increases of cumulative columns (rows = scrapes); a decrease means a reset: count from 0."""
    diff = wide.diff()
    return diff.where(diff >= 0, wide).iloc[1:]


def counter_rate(frame: pd.DataFrame, name: str, by: str | None = None,
                 where: dict[str, str] | None = None, exclude: dict[str, str] | None = None) -> pd.DataFrame:
    """Per-second increase of a counter between consecutive scrapes, summed over series (or per label `by`).
    Columns: ts, [by], rate. An idle interval gives 0."""
    f = frame[frame["name"] == name]
    for key, value in (where or {}).items():
        f = f[_label(f, key) == value]
    for key, value in (exclude or {}).items():
        f = f[_label(f, key) != value]
    all_ts = sorted(frame["ts"].unique())
    if len(all_ts) < 2:
        return pd.DataFrame(columns=["ts", *([by] if by else []), "rate"])
    f = f.assign(series=f["labels"], group=_label(f, by) if by else "")
    wide = f.pivot_table(index="ts", columns="series", values="value", aggfunc="sum").reindex(all_ts).ffill().fillna(0)
    inc = _deltas(wide)
    seconds = pd.Series(np.diff(all_ts), index=all_ts[1:])
    groups = f.drop_duplicates("series").set_index("series")["group"]
    summed = inc.T.groupby(groups.reindex(inc.columns).values).sum().T if len(inc.columns) else \
        pd.DataFrame({"": 0.0}, index=inc.index)
    rates = summed.div(seconds, axis=0).reset_index(names="ts")
    long = rates.melt(id_vars="ts", var_name=by or "series", value_name="rate")
    return long if by else long[["ts", "rate"]]


def bucket_quantile(bounds: np.ndarray, counts: np.ndarray, q: float) -> float:
    """Prometheus histogram_quantile over cumulative bucket counts (bounds ascending, last = +Inf)."""
    total = counts[-1] if len(counts) else 0
    if total <= 0:
        return math.nan
    rank = q * total
    i = int(np.searchsorted(counts, rank, side="left"))
    if i >= len(bounds) - 1:  # in the +Inf bucket: the highest finite bound is all we know
        return float(bounds[-2]) if len(bounds) > 1 else math.nan
    lo_bound = bounds[i - 1] if i > 0 else 0.0
    lo_count = counts[i - 1] if i > 0 else 0.0
    inside = counts[i] - lo_count
    return float(lo_bound + (bounds[i] - lo_bound) * ((rank - lo_count) / inside if inside > 0 else 1.0))


def _bucket_table(frame: pd.DataFrame, base: str, by: str | None) -> pd.DataFrame:
    f = frame[frame["name"] == f"{base}_bucket"]
    f = f.assign(group=_label(f, by) if by else "")
    table = f.pivot_table(index="ts", columns=["group", "le"], values="value", aggfunc="sum").sort_index(axis=1)
    return table.reindex(sorted(frame["ts"].unique()))


def quantile_series(frame: pd.DataFrame, base: str, q: float = 0.95, by: str | None = None) -> pd.DataFrame:
    """q-quantile of the observations made in each interval between scrapes, in ms, plus their count.
    Columns: ts, [by], value_ms, observations. Intervals without observations are left out."""
    cols = ["ts", *([by] if by else []), "value_ms", "observations"]
    table = _bucket_table(frame, base, by)
    if len(table) < 2:
        return pd.DataFrame(columns=cols)
    inc = _deltas(table.ffill().fillna(0))
    rows = []
    for group in inc.columns.get_level_values(0).unique():
        sub = inc[group]
        bounds = np.asarray(sub.columns, dtype=float)
        for ts, counts in sub.iterrows():
            n = float(counts.iloc[-1])
            if n > 0:
                rows.append({"ts": ts, **({by: group} if by else {}),
                             "value_ms": bucket_quantile(bounds, counts.to_numpy(), q) * 1000, "observations": n})
    return pd.DataFrame(rows, columns=cols)


def window_quantile(store_path, base: str, q: float, window_s: float, now: float) -> dict:
    """The q-quantile (ms) of all observations in the last `window_s` before the newest scrape, how many
    there were, when that scrape was taken and when the newest observation was seen (the first scrape
    whose count had grown). value_ms is None when the window saw no observation."""
    frame = load(store_path, now - window_s, now, 1e-3, [f"{base}_bucket", f"{base}_count"])
    out = {"value_ms": None, "observations": 0, "window_s": window_s, "as_of": None, "last_observed": None}
    if frame.empty:
        return out
    counts = frame[frame["name"] == f"{base}_count"].groupby("ts")["value"].sum()
    counts = counts.reindex(sorted(frame["ts"].unique()), fill_value=0.0)
    out["as_of"] = float(counts.index.max())
    grew = counts.diff() > 0
    if grew.any():
        out["last_observed"] = float(counts.index[grew.to_numpy()].max())
    table = _bucket_table(frame, base, None).ffill().fillna(0)
    if len(table) < 2 or table.columns.empty:  # fewer than two scrapes, or the histogram has no series yet
        return out
    inc = _deltas(table).sum()[""]  # summed over the window; resets handled interval by interval
    bounds = np.asarray(inc.index, dtype=float)
    n = float(inc.iloc[-1])
    if n > 0:
        out["value_ms"] = bucket_quantile(bounds, inc.to_numpy(), q) * 1000
        out["observations"] = int(round(n))
    return out


def gauge_series(frame: pd.DataFrame, name: str, by: str) -> pd.DataFrame:
    """A gauge's value per scrape and label `by` (e.g. replica). Columns: ts, <by>, value."""
    f = frame[frame["name"] == name]
    return pd.DataFrame({"ts": f["ts"], by: _label(f, by), "value": f["value"]}).reset_index(drop=True)


def serving_replicas(rows: list[tuple]) -> list[tuple[str, str, str]]:
    """(replica, model, version) of the replicas with a fresh state report in one scrape (their KV gauge)."""
    out = []
    for name, labels, _le, _value in rows:
        if name == "fleet_router_replica_kv_utilisation":
            d = json.loads(labels)
            out.append((d.get("replica", ""), d.get("model", ""), d.get("version", "")))
    return out


def sum_hours(rows: list[tuple]) -> list[tuple]:
    """GPU-hour rows (day, model, version, hours) summed per (day, model, version)."""
    totals: dict[tuple, float] = {}
    for day, model, version, hours in rows:
        totals[(day, model, version)] = totals.get((day, model, version), 0.0) + hours
    return [(*key, hours) for key, hours in totals.items()]


def replica_hours(ts: float, seconds: float, replicas: list[tuple[str, str, str]],
                  gpus_per_replica: dict[tuple[str, str], int]) -> list[tuple[str, str, str, float]]:
    """(day, model, version, GPU-hours) for `seconds` of every reporting replica, times its GPUs: what the
    scraper adds to the lake's gpu_hours (usage/price_tables.py), which chargeback splits over teams
    (hours no request used become the '(idle)' share)."""
    day = time.strftime("%Y-%m-%d", time.gmtime(ts))
    hours: dict[tuple[str, str], float] = {}
    for _replica, model, version in replicas:
        key = (model, version)
        hours[key] = hours.get(key, 0.0) + seconds / 3600 * gpus_per_replica.get(key, 1)
    return [(day, model, version, h) for (model, version), h in hours.items()]
