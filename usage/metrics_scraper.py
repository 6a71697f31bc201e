"""The metrics scraper: every few seconds, read every router's Prometheus `/metrics` (each router's own
listener: behind one shared port a scrape would reach a random router), merge them into one fleet-wide scrape
(`fleet_metrics.merge_routers`) and append the kept samples to the usage store's `router_metrics` table
(usage/fleet_metrics.py), so the admin UI's Fleet page and the automatic rollback rules see all the traffic, and add the scrape interval of every reporting replica (times its tensor-parallel GPUs) to the
store's `gpu_hours` table, so chargeback has GPU-hours and their idle share; once a minute, evaluate the
armed automatic rollback rules (usage/auto_rollback.py).

Started by `fleet up` as process `metrics-scraper` (`fleet usage scrape-metrics`). It writes the DuckDB file
for ~10 ms per scrape and retries while the loader holds it; a router that is down is logged and skipped.
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path

import httpx

from registry import queries
from registry.db import session_scope
from usage import auto_rollback, fleet_metrics, price_tables, store
from usage.lake import lake_for

log = logging.getLogger(__name__)


def read_routers(router_urls: str | list[str]) -> list[list[tuple]]:
    """Each router's kept samples, in order; a router that cannot be read is logged and left out (its series
    pause). Raises the last httpx error when no router can be read."""
    urls = router_urls.split(",") if isinstance(router_urls, str) else router_urls
    pages, error = [], None
    for url in urls:
        try:
            resp = httpx.get(f"{url.strip().rstrip('/')}/metrics", timeout=5.0)
            resp.raise_for_status()
            pages.append(fleet_metrics.parse_samples(resp.text))
        except httpx.HTTPError as exc:
            log.warning("cannot scrape %s/metrics: %s", url, exc)
            pages.append([])
            error = exc
    if error is not None and not any(pages):
        raise error
    return pages


GPU_HOURS_FLUSH_S = 60.0  # one lake commit of GPU-hours a minute, not one per scrape (each commit is a version)


def scrape_once(router_url: str | list[str], store_path: Path, retention_s: float, now: float | None = None,
                replica_seconds: float = 0.0, gpus_per_replica: dict[tuple[str, str], int] | None = None,
                gpu_hours: list | None = None) -> int:
    """One scrape of every router (comma-separated URLs or a list) into the store; returns the number of
    samples kept. With `replica_seconds` > 0, that many seconds of each reporting replica are GPU-hours (once
    per replica, however many routers relay it): appended to `gpu_hours` when given (the caller flushes them),
    else added to the lake now. Raises httpx errors when no router can be read."""
    rows = fleet_metrics.merge_routers(read_routers(router_url))
    now = now if now is not None else time.time()
    with store.connect(store_path) as con:
        kept = fleet_metrics.record(con, now, rows, retention_s)
    if replica_seconds > 0:  # into the lake, where every pod's chargeback reads them
        hours = fleet_metrics.replica_hours(now, replica_seconds, fleet_metrics.serving_replicas(rows),
                                            gpus_per_replica or {})
        if gpu_hours is None:
            price_tables.add_gpu_hours(lake_for(store_path), hours)
        else:
            gpu_hours.extend(hours)
    return kept


def flush_gpu_hours(store_path: Path, pending: list) -> None:
    """Add the buffered GPU-hours to the lake in one commit (add_gpu_hours sums rows of one key)."""
    if pending:
        price_tables.add_gpu_hours(lake_for(store_path), pending)
        pending.clear()


def gpus_per_replica(db_url: str) -> dict[tuple[str, str], int]:
    """(model, version) -> tensor-parallel GPUs of one replica, from the registry."""
    with session_scope(db_url) as s:
        return {(m.name, m.version): int(m.tensor_parallel or 1) for m in queries.list_model_versions(s)}


def run(router_url: str, store_path: Path, db_url: str, interval_s: float, retention_s: float,
        rollback_every_s: float = 60.0, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    last_rules = 0.0
    last_scrape: float | None = None
    last_flush, pending_hours = time.time(), []
    gpus: dict[tuple[str, str], int] = {}
    failing = False
    log.info("scraping %s every %.0f s into %s (kept %.1f days)",
             ", ".join(f"{u.strip().rstrip('/')}/metrics" for u in str(router_url).split(",")), interval_s,
             store_path, retention_s / 86400)
    while not stop.is_set():
        started = time.time()
        # a replica reporting now is counted for the time since the last good scrape, at most two intervals
        # (after an outage the time in between is not known, so it is not billed)
        seconds = min(started - last_scrape, 2 * interval_s) if last_scrape is not None else 0.0
        if started - last_rules >= rollback_every_s or not gpus:
            try:
                gpus = gpus_per_replica(db_url)
            except Exception as exc:  # registry down: count 1 GPU per replica until it is back
                log.warning("cannot read GPUs per replica from the registry: %s", exc)
        try:
            n = scrape_once(router_url, store_path, retention_s, started, seconds, gpus, pending_hours)
            last_scrape = started
            if failing:
                log.info("router metrics readable again (%d samples)", n)
            failing = False
        except (httpx.HTTPError, OSError) as exc:
            last_scrape = None
            if not failing:
                log.warning("cannot scrape %s/metrics: %s; retrying every %.0f s", router_url, exc, interval_s)
            failing = True
        if started - last_rules >= rollback_every_s:
            last_rules = started
            try:
                for fired in auto_rollback.evaluate(store_path, db_url, now=started):
                    log.warning("automatic rollback: %s", fired)
            except Exception:  # a registry or store hiccup must not stop the scraping
                log.exception("evaluating rollback rules failed; next try in %.0f s", rollback_every_s)
        if started - last_flush >= GPU_HOURS_FLUSH_S:
            last_flush = started
            try:
                flush_gpu_hours(store_path, pending_hours)
            except Exception:  # the lake unreachable: keep them (summed per key, so bounded) for the next try
                pending_hours[:] = fleet_metrics.sum_hours(pending_hours)
                log.exception("cannot add GPU-hours to the lake; %d rows kept for the next try", len(pending_hours))
        stop.wait(max(0.0, interval_s - (time.time() - started)))
    try:
        flush_gpu_hours(store_path, pending_hours)  # a clean stop loses no GPU-hours
    except Exception:
        log.exception("cannot add the last %d GPU-hour rows to the lake", len(pending_hours))


def add_arguments(parser: argparse.ArgumentParser, settings) -> None:
    parser.add_argument("--router-url", default=",".join(settings.router_metrics_urls),
                        help="every router's metrics base URL, comma-separated (default: each router's own "
                             "listener, %(default)s)")
    parser.add_argument("--store", type=Path, default=settings.usage_db_path, help="DuckDB file (default: %(default)s)")
    parser.add_argument("--interval", type=float, default=settings.metrics_scrape_s,
                        help="seconds between scrapes (default: FLEET_METRICS_SCRAPE_S or %(default)s)")
    parser.add_argument("--retention-days", type=float, default=7.0, help="history kept (default: %(default)s)")
    parser.add_argument("--rules-every", type=float, default=60.0,
                        help="seconds between evaluations of the automatic rollback rules (default: %(default)s)")


def run_from_args(args: argparse.Namespace, settings) -> int:
    if not 0.5 <= args.interval <= 3600:
        raise SystemExit(f"--interval is {args.interval}; allowed 0.5..3600 seconds")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(args.router_url, args.store, settings.db_url, args.interval, args.retention_days * 86400,
        args.rules_every, stop)
    return 0
