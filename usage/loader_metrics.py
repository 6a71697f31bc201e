"""Prometheus metrics of the usage loader (Kafka -> DuckDB), served on Settings.usage_metrics_port
(FLEET_USAGE_METRICS_PORT; 0 = not served): what it consumed, stored, found duplicate, dead-lettered, its
errors, when it last stored a batch, its consumer lag, and each team's month-to-date cost against its monthly
budget. Counters are read from the loader's own at each scrape (a collector), so the load path has no metric
calls; lag and spend are refreshed on the loader's own thread (the Kafka consumer and the DuckDB file are
its), at most every LAG_EVERY_S / SPEND_EVERY_S. Documented in docs/observability.md."""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from registry.budgets import list_budgets
from registry.db import session_scope
from usage.chargeback import cost_table

log = logging.getLogger(__name__)
LAG_EVERY_S = 10.0  # consumer lag costs the broker a round trip: asked at most this often
SPEND_EVERY_S = 60.0  # month-to-date cost per team: one DuckDB query and one registry read
# loader.stats key -> (counter name, without the _total the exposition adds; help)
COUNTERS = {"consumed": ("fleet_usage_loader_consumed", "usage events read from Kafka"),
            "inserted": ("fleet_usage_loader_inserted", "usage events stored in DuckDB"),
            "duplicates": ("fleet_usage_loader_duplicates", "usage events already stored (re-deliveries, repeats)"),
            "rejected": ("fleet_usage_loader_dead_letters", "usage events sent to the dead-letter topic"),
            "errors": ("fleet_usage_loader_errors", "loader batches that failed (broker or store error; retried)")}


class LoaderCollector:
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def collect(self):
        stats = self.loader.stats
        for key, (name, help_text) in COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=stats.get(key, 0))
        yield GaugeMetricFamily("fleet_usage_loader_last_store_timestamp_seconds", "Unix time the loader last "
                                "stored a batch (its start time until then)",
                                value=getattr(self.loader, "last_stored_at", 0.0) or self.loader.started_at)
        yield GaugeMetricFamily("fleet_usage_loader_lag_events", "Usage events in Kafka not yet consumed by this "
                                "loader (end offsets - positions of its partitions)", value=self.loader.lag)
        spend = GaugeMetricFamily("fleet_usage_team_month_cost", "A team's month-to-date cost (platform currency)",
                                  labels=["team"])
        budget = GaugeMetricFamily("fleet_usage_team_month_budget", "A team's monthly budget (platform currency; "
                                   "teams with a budget only)", labels=["team"])
        for team, (cost, amount) in sorted(getattr(self.loader, "team_spend", {}).items()):
            spend.add_metric([team], cost)
            if amount is not None:
                budget.add_metric([team], amount)
        yield spend
        yield budget


def consumer_lag(consumer: Any) -> int:
    """Events behind the end of the assigned partitions (0 with no assignment yet)."""
    parts = consumer.assignment()
    if not parts:
        return 0
    ends = consumer.end_offsets(list(parts))
    return int(sum(max(0, ends[tp] - consumer.position(tp)) for tp in parts))


def serve(loader: Any, host: str, port: int) -> None:
    """Serve the loader's metrics on host:port (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(LoaderCollector(loader))
    start_http_server(port, addr=host, registry=registry)
    log.info("usage loader metrics on http://%s:%d/metrics", host, port)


def refresh_lag(loader: Any, now: float) -> None:
    """Called from the loader's own thread (kafka-python's consumer is not thread safe)."""
    if now - loader.lag_checked_at < LAG_EVERY_S or loader._consumer is None:
        return
    loader.lag_checked_at = now
    try:
        loader.lag = consumer_lag(loader._consumer)
    except Exception as exc:  # the broker briefly away: keep the last value
        log.debug("consumer lag not read: %s", exc)


def refresh_spend(loader: Any, now: float, db_url: str) -> None:
    """team -> (month-to-date cost, monthly budget or None), on the loader's thread."""
    if not db_url or now - getattr(loader, "spend_checked_at", 0.0) < SPEND_EVERY_S:
        return
    loader.spend_checked_at = now
    try:
        today = dt.datetime.now(dt.timezone.utc).date()
        mtd = cost_table(loader.store_path, today.replace(day=1), today + dt.timedelta(days=1), group_by=("team",))
        with session_scope(db_url) as s:
            amounts = {b.team: b.monthly_amount for b in list_budgets(s)}
        costs = dict(zip(mtd["team"], mtd["cost_total"])) if not mtd.empty else {}
        loader.team_spend = {t: (float(costs.get(t, 0.0)), amounts.get(t)) for t in {*costs, *amounts}}
    except Exception as exc:  # the store or registry briefly away: keep the last values
        log.debug("team spend not read: %s", exc)


def mark_stored(loader: Any) -> None:
    loader.last_stored_at = time.time()
