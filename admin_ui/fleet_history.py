"""The Fleet page's history: router metrics kept by the metrics scraper (usage/fleet_metrics.py), turned
into the series and headline numbers the page shows for a chosen time range."""
from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd

from admin_ui.usage_data import store_path
from usage import fleet_metrics as fm

RANGES = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
WINDOWS = {"1 min": 60, "5 min": 300, "15 min": 900}
POINTS = 120  # about this many points per chart, whatever the range
NAMES = ["fleet_router_requests_total", "fleet_router_completion_tokens_total", "fleet_router_ttft_seconds_bucket",
         "fleet_router_queue_wait_seconds_bucket", "fleet_router_queue_depth", "fleet_router_replica_kv_utilisation"]


@dataclass
class History:
    range_s: int
    step_s: float
    tokens_per_s: pd.DataFrame  # ts, rate
    requests: pd.DataFrame      # ts, status, rate
    error_rate: pd.DataFrame    # ts, error_rate
    ttft_p95: pd.DataFrame      # ts, tier, value_ms
    queue_wait_p95: pd.DataFrame
    queue_depth: pd.DataFrame   # ts, value
    kv: pd.DataFrame            # ts, replica, value

    @property
    def empty(self) -> bool:
        return self.tokens_per_s.empty and self.kv.empty


def history(range_key: str, now: float | None = None, scrape_s: float = 10.0, path=None) -> History:
    now = now if now is not None else time.time()
    range_s = RANGES[range_key]
    step = max(scrape_s, range_s / POINTS)
    frame = fm.load(store_path(path), now - range_s, now, step, NAMES)
    requests = fm.counter_rate(frame, "fleet_router_requests_total", by="status")
    if requests.empty:
        errors = pd.DataFrame(columns=["ts", "error_rate"])
    else:
        wide = requests.pivot_table(index="ts", columns="status", values="rate", aggfunc="sum").fillna(0)
        total = wide.sum(axis=1)
        errors = pd.DataFrame({"ts": wide.index, "error_rate": (wide.get("error", 0) / total.where(total > 0)).fillna(0)})
    depth = fm.gauge_series(frame, "fleet_router_queue_depth", "tier").groupby("ts", as_index=False)["value"].sum()
    return History(range_s, step, fm.counter_rate(frame, "fleet_router_completion_tokens_total"), requests, errors,
                   fm.quantile_series(frame, "fleet_router_ttft_seconds", 0.95, by="tier"),
                   fm.quantile_series(frame, "fleet_router_queue_wait_seconds", 0.95, by="tier"), depth,
                   fm.gauge_series(frame, "fleet_router_replica_kv_utilisation", "replica"))


def headline(window_s: int, now: float | None = None, scrape_s: float = 10.0, path=None) -> dict:
    """TTFT and queue-wait p95 over the last `window_s` (with the scrape time and the newest request seen),
    and tokens/s and the error rate between the two newest scrapes (None before two scrapes)."""
    now = now if now is not None else time.time()
    recent = fm.load(store_path(path), now - 5 * scrape_s, now, 1e-3, NAMES[:2])
    tokens = fm.counter_rate(recent, "fleet_router_completion_tokens_total")
    requests = fm.counter_rate(recent, "fleet_router_requests_total", by="status")
    last = requests[requests["ts"] == requests["ts"].max()] if not requests.empty else requests
    total = float(last["rate"].sum()) if not last.empty else 0.0
    return {"ttft": fm.window_quantile(store_path(path), "fleet_router_ttft_seconds", 0.95, window_s, now),
            "queue_wait": fm.window_quantile(store_path(path), "fleet_router_queue_wait_seconds", 0.95, window_s, now),
            "tokens_per_s": float(tokens["rate"].iloc[-1]) if not tokens.empty else None,
            "error_rate": float(last.loc[last["status"] == "error", "rate"].sum()) / total if total else 0.0}


def age_text(ts: float | None, now: float) -> str:
    if ts is None:
        return "never"
    seconds = max(0, now - ts)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago" if seconds < 7200 \
        else f"{seconds / 3600:.1f} h ago"
