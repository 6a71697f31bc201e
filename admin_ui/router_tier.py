"""The Fleet page's table of routers (`fleet up --routers N`): each router's own view, one row per router.

- up, streams in flight (its `fleet_router_inflight_requests`, all replicas) and requests waiting in its
  admission queues (`fleet_router_queue_depth`): read now from that router's own `/metrics` on its internal
  listener, the URL the metrics scraper reads (behind the shared port a read would reach a random router);
- admitted/s: requests it admitted and finished per second between the metrics scraper's two newest scrapes
  (`fleet_router_requests_total`, one series per router: usage/fleet_metrics.merge_routers' `router` label).

The replica table beside it comes from whichever router answers `/admin/fleet`: replica states are the
shared reports, so any router gives the same ones; in-flight and queue counts are per router, hence this table.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import duckdb
import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from usage import fleet_metrics as fm

log = logging.getLogger(__name__)
COLUMNS = ["router", "url", "up", "inflight", "queued", "admitted_per_s", "error"]
READ_TIMEOUT_S = 1.0   # a live table: a router that does not answer within this is shown down


def read_router(url: str, timeout_s: float = READ_TIMEOUT_S) -> dict:
    """One router's own numbers now: {up, inflight, queued, error}."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        return {"up": False, "inflight": None, "queued": None, "error": f"{type(exc).__name__}: {exc}"[:200]}
    sums = {"fleet_router_inflight_requests": 0.0, "fleet_router_queue_depth": 0.0}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name in sums:
                sums[s.name] += float(s.value)
    return {"up": True, "inflight": sums["fleet_router_inflight_requests"],
            "queued": sums["fleet_router_queue_depth"], "error": ""}


def admitted_per_s(store_path: Path, routers: int, now: float | None = None, scrape_s: float = 10.0) -> dict[str, float]:
    """router index -> requests finished per second between the scraper's two newest scrapes (none before two).
    With one router the scraper stores no `router` label: its series are router 0's."""
    now = time.time() if now is None else now
    frame = fm.load(store_path, now - 5 * scrape_s, now, 1e-3, ["fleet_router_requests_total"])
    rates = fm.counter_rate(frame, "fleet_router_requests_total", by="router")
    if rates.empty:
        return {}
    last = rates[rates["ts"] == rates["ts"].max()]
    out: dict[str, float] = {}
    for router, rate in zip(last["router"], last["rate"]):
        key = router if routers > 1 and router != "" else "0"
        out[key] = out.get(key, 0.0) + float(rate)
    return out


def routers_frame(urls: list[str], store_path: Path, now: float | None = None, scrape_s: float = 10.0) -> pd.DataFrame:
    """One row per router: index, its internal URL, and the columns above (None where not known: admitted/s
    when the usage store cannot be read now, so the routers' up/down still shows)."""
    try:
        admitted = admitted_per_s(store_path, len(urls), now, scrape_s)
    except (duckdb.Error, OSError) as exc:
        log.warning("admitted/s per router: the usage store %s cannot be read: %s", store_path, exc)
        admitted = {}
    rows = [{"router": i, "url": url, **read_router(url), "admitted_per_s": admitted.get(str(i))}
            for i, url in enumerate(urls)]
    return pd.DataFrame(rows, columns=COLUMNS)
