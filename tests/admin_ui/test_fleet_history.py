"""Fleet history: the metrics scraper reads the real router's /metrics over HTTP into the usage store;
rates and windowed p95 come out as Prometheus would compute them; the Fleet page charts them."""
from __future__ import annotations

import math

import numpy as np
import pytest

from router_service import metrics
from tests.admin_ui.stack import MODEL
from usage import fleet_metrics as fm
from usage.metrics_scraper import scrape_once


def test_bucket_quantile_interpolates_like_prometheus():
    bounds = np.array([0.1, 0.5, 1.0, math.inf])
    assert fm.bucket_quantile(bounds, np.array([0, 10, 10, 10.0]), 0.95) == pytest.approx(0.1 + 0.4 * 0.95)
    assert fm.bucket_quantile(bounds, np.array([0, 0, 0, 4.0]), 0.5) == 1.0, "+Inf bucket: highest finite bound"
    assert math.isnan(fm.bucket_quantile(bounds, np.array([0, 0, 0, 0.0]), 0.5))


def test_scraped_history_gives_rates_that_fall_to_zero_and_a_windowed_p95(stack, page):
    url, path = f"http://127.0.0.1:{stack.port}", stack.data_dir / "usage.duckdb"
    t0 = 1_800_000_000.0
    assert scrape_once(url, path, 86400, now=t0) > 0
    # what the router records when it finishes requests (router_service/accounting.py)
    for ttft in (0.2, 0.3, 0.4, 0.45):
        metrics.TTFT.labels(MODEL, "interactive").observe(ttft)
        metrics.REQUESTS.labels(MODEL, "interactive", "ok").inc()
    metrics.REQUESTS.labels(MODEL, "interactive", "error").inc()
    metrics.TOKENS.labels(MODEL, "interactive").inc(200)
    scrape_once(url, path, 86400, now=t0 + 10)
    scrape_once(url, path, 86400, now=t0 + 20)  # idle interval
    frame = fm.load(path, t0 - 1, t0 + 20, 1e-3, ["fleet_router_completion_tokens_total",
                                                     "fleet_router_requests_total"])
    tokens = fm.counter_rate(frame, "fleet_router_completion_tokens_total")
    assert tokens["rate"].tolist() == pytest.approx([20.0, 0.0]), "200 tokens in 10 s, then idle = 0"
    by_status = fm.counter_rate(frame, "fleet_router_requests_total", by="status")
    first = by_status[by_status["ts"] == t0 + 10].set_index("status")["rate"]
    assert first["ok"] == pytest.approx(0.4) and first["error"] == pytest.approx(0.1)
    p95 = fm.window_quantile(path, "fleet_router_ttft_seconds", 0.95, 300, now=t0 + 20)
    assert p95["observations"] == 4 and 250 <= p95["value_ms"] <= 500
    assert p95["as_of"] == t0 + 20 and p95["last_observed"] == t0 + 10, "the age of the newest request is known"
    later = fm.window_quantile(path, "fleet_router_ttft_seconds", 0.95, 5, now=t0 + 20)
    assert later["value_ms"] is None and later["observations"] == 0, "nothing in the last 5 s: no stale p95"


def test_the_fleet_page_charts_the_history_and_states_the_p95_window(stack, page):
    import time
    url, path = f"http://127.0.0.1:{stack.port}", stack.data_dir / "usage.duckdb"
    now = time.time()
    scrape_once(url, path, 86400, now=now - 30)
    metrics.TTFT.labels(MODEL, "interactive").observe(0.3)
    metrics.TOKENS.labels(MODEL, "interactive").inc(50)
    scrape_once(url, path, 86400, now=now - 20)
    scrape_once(url, path, 86400, now=now - 10)
    at = page("fleet")
    assert not at.exception, at.exception
    labels = {m.label: m.value for m in at.metric}
    assert labels["TTFT p95, last 5 min"].endswith(" ms")
    assert labels["tokens/s, last scrape interval"] == "0.0", "idle since the last request"
    assert len(at.get("plotly_chart")) == 2 + 6
    at.segmented_control(key="fleet_range").set_value("6h").run()
    assert not at.exception and at.query_params["range"] == "6h", "the range is in the URL"


def test_each_scrape_adds_the_reporting_replicas_gpu_hours(stack):
    from usage import chargeback, store
    from usage.metrics_scraper import gpus_per_replica
    url, path = f"http://127.0.0.1:{stack.port}", stack.data_dir / "usage.duckdb"
    gpus = gpus_per_replica(stack.db_url)
    assert gpus[(MODEL, "1")] == 1
    scrape_once(url, path, 86400, replica_seconds=1800, gpus_per_replica={**gpus, (MODEL, "2"): 4})
    with store.connect(path, read_only=True) as con:
        hours = dict(con.execute("SELECT version, gpu_hours FROM gpu_hours").fetchall())
    assert hours == {"1": pytest.approx(1.0), "2": pytest.approx(2.0)}, "2 replicas x 0.5 h; 1 x 0.5 h x 4 GPUs"
    by_team = chargeback.gpu_hours_by_team(path)
    assert by_team["gpu_hours"].sum() == pytest.approx(3.0)


def test_the_scrapers_gpu_hours_reach_the_lake_in_one_commit_per_flush(stack):
    """The running scraper buffers GPU-hours and adds them once a minute (a lake commit per 2-10 s scrape made
    thousands of table versions a day and kept a core busy): buffered scrapes write nothing, the flush sums them."""
    from usage import store
    from usage.metrics_scraper import flush_gpu_hours, gpus_per_replica
    url, path = f"http://127.0.0.1:{stack.port}", stack.data_dir / "usage.duckdb"
    gpus = {**gpus_per_replica(stack.db_url), (MODEL, "2"): 4}

    def hours() -> dict:
        with store.connect(path, read_only=True) as con:
            return dict(con.execute("SELECT version, gpu_hours FROM gpu_hours").fetchall())
    before, pending = hours(), []
    for _ in range(3):
        scrape_once(url, path, 86400, replica_seconds=600, gpus_per_replica=gpus, gpu_hours=pending)
    assert hours() == before and pending, "buffered: nothing written per scrape"
    flush_gpu_hours(path, pending)
    after = hours()
    assert pending == [] and after["1"] - before.get("1", 0.0) == pytest.approx(1.0), "3 x 2 replicas x 10 min"
    assert after["2"] - before.get("2", 0.0) == pytest.approx(2.0), "3 x 1 replica x 10 min x 4 GPUs"
