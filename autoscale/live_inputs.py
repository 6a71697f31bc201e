"""Inputs the live controller gets besides the router's signals: a forecast fitted from the usage store's
history, and the batch demand read from the router's admission queues.

Forecast: hourly interactive + standard request counts per model from the usage store (`usage_rollups`,
batch excluded: batch is scheduled by deadline, not forecast), the missing hours filled with 0. Holt-Winters
with a weekly season needs two weeks of history; with two days a daily season is used; with less there
is no forecast and the controller stays reactive + warm buffer (and says so in its log).

Batch demand: batch requests waiting in the admission queues x replica-seconds per request, spread over
the time to the earliest queued deadline (at most `horizon_s`), is the extra capacity the policy adds.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from autoscale.forecast import LoadForecaster
from autoscale.signals import Signals

log = logging.getLogger(__name__)
WEEK_H, DAY_H = 168, 24


def usage_history(store_path: Path, model: str, until_s: float, weeks: int = 3) -> pd.Series:
    """Hourly request counts (interactive + standard) of one model for `weeks` weeks before `until_s`."""
    from usage.store import connect

    since = until_s - weeks * WEEK_H * 3600.0
    with connect(store_path, read_only=True) as con:
        frame = con.execute(
            "SELECT hour / 3600 AS hour, sum(requests) AS n FROM usage_rollups "
            "WHERE model = ? AND priority <> 'batch' AND hour >= ? AND hour < ? GROUP BY 1 ORDER BY 1",
            [model, since, until_s]).df()
    if frame.empty:
        return pd.Series(dtype=float)
    first = int(frame["hour"].min())
    hours = range(first, int(until_s // 3600))
    counts = frame.set_index(frame["hour"].astype(int))["n"].reindex(hours, fill_value=0).astype(float)
    counts.index = pd.to_datetime([h * 3600 for h in hours], unit="s", utc=True)
    return counts


def fit_forecast(history: pd.Series, history_end_s: float, horizon_h: int = 48,
                 clock: Callable[[], float] = time.monotonic) -> Callable[[float], float] | None:
    """A `now (controller clock) -> requests/s` forecast, or None when the history is too short."""
    season = WEEK_H if len(history) >= 2 * WEEK_H else DAY_H if len(history) >= 2 * DAY_H else None
    if season is None:
        log.info("forecast: %d hours of usage history, need >= %d; staying reactive", len(history), 2 * DAY_H)
        return None
    forecaster = LoadForecaster(seasonal_periods=season).fit(history, horizon_h=horizon_h)
    offset = time.time() - clock()  # controller clock -> wall clock
    return lambda now: float(forecaster.predict(float(now + offset - history_end_s)))


def mean_stream_s(store_path: Path, model: str, since_s: float) -> float | None:
    """Mean duration of the model's finished interactive/standard streams since `since_s` (None: none)."""
    from usage.store import connect

    with connect(store_path, read_only=True) as con:
        value = con.execute("SELECT avg(duration_ms) FROM usage_events WHERE model = ? AND priority <> 'batch' "
                            "AND status = 'ok' AND ts >= ? "
                            "AND day >= CAST(to_timestamp(?) AT TIME ZONE 'UTC' AS DATE)",  # prunes day partitions
                            [model, since_s, since_s]).fetchall()[0][0]
    return float(value) / 1000.0 if value else None


def forecasts_from_usage(store_path: Path, pools, weeks: int = 3) -> dict[str, Callable[[float], float]]:
    """One forecast per pool (keyed by pool name) whose model has enough history in the usage store.

    A forecast in requests/s becomes replicas through the pool's replica-seconds per request, set here
    from the same history: mean stream duration / streams a replica runs at once."""
    from usage.lake import lake_for

    if not Path(store_path).exists() and not lake_for(Path(store_path)).exists():
        log.info("forecast: no usage store at %s; staying reactive", store_path)
        return {}
    end = time.time() // 3600 * 3600  # the last full hour
    out = {}
    for pool in pools:
        history = usage_history(Path(store_path), pool.spec.model, end, weeks)
        fc = fit_forecast(history, end)
        if fc is not None:
            out[pool.spec.name] = fc
            stream_s = mean_stream_s(Path(store_path), pool.spec.model, end - weeks * WEEK_H * 3600.0)
            if stream_s:
                pool.replica_seconds_per_request = stream_s / max(pool.max_running_per_replica, 1)
            log.info("forecast for %s fitted on %d hours of usage", pool.spec.name, len(history))
    return out


def batch_demand(signals: Signals, replica_seconds_per_request: float, horizon_s: float = 600.0,
                 min_window_s: float = 30.0) -> float:
    """Replica-s/s the queued batch requests need to finish by the earliest deadline (or within horizon_s)."""
    if signals.batch_waiting <= 0:
        return 0.0
    window = horizon_s if signals.batch_deadline_s is None else min(horizon_s, signals.batch_deadline_s)
    return signals.batch_waiting * replica_seconds_per_request / max(window, min_window_s)
