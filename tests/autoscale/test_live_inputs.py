"""Live controller inputs: forecast fitted from a real usage store (DuckDB), batch demand from the router's
admission queues, and the local actuator's CPU budget."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.actuators.local import LocalActuator, LocalReplica, engine_threads
from autoscale.actuators.replicas import ReplicaSpec
from autoscale.controller import Controller, PoolConfig
from autoscale.live_inputs import batch_demand, forecasts_from_usage, usage_history
from autoscale.signals import Signals, parse_fleet
from common.settings import load_settings
from router_service.admission import AdmissionQueue, Ticket
from usage.store import EVENT_COLUMNS, connect, insert_events


def _events(end_s: float, hours: int, model: str = "m") -> pd.DataFrame:
    """Hourly traffic with a daily curve (peak at 14:00 UTC), 2 s streams, plus batch rows that must be ignored."""
    rows = []
    for h in range(hours):
        hour_start = end_s - (hours - h) * 3600.0
        hour_of_day = (hour_start / 3600.0) % 24
        n = int(round(4 + 16 * (1 + math.cos(2 * math.pi * (hour_of_day - 14) / 24)) / 2))
        for i in range(n):
            rows.append({"request_id": f"r{h}-{i}", "ts": hour_start + 60.0 * i, "priority": "interactive"})
        rows.append({"request_id": f"b{h}", "ts": hour_start + 30.0, "priority": "batch"})
    frame = pd.DataFrame(rows)
    for col, value in (("caller", "c"), ("team", "t"), ("model", model), ("version", "1"), ("adapter", ""),
                       ("region", "local"), ("replica_id", "m-1-r0"), ("prompt_tokens", 100),
                       ("cached_prompt_tokens", 0), ("completion_tokens", 20), ("ttft_ms", 50.0),
                       ("duration_ms", 2000.0), ("finish_reason", "stop"), ("status", "ok")):
        frame[col] = value
    return frame[EVENT_COLUMNS]


def test_forecast_is_fitted_from_the_usage_store(tmp_path) -> None:
    store = tmp_path / "usage.duckdb"
    end = time.time() // 3600 * 3600
    with connect(store) as con:
        insert_events(con, _events(end, 15 * 24))
    history = usage_history(store, "m", end, weeks=3)
    assert len(history) == 15 * 24 and history.max() == 20 and history.min() == 4  # batch rows excluded
    pool = PoolConfig(PoolSpec("m", "1"), max_running_per_replica=4)
    forecasts = forecasts_from_usage(store, [pool], weeks=3)
    fc = forecasts[pool.spec.name]
    now = time.monotonic()
    ahead = np.arange(0, 24) * 3600.0
    hours_of_day = ((end + ahead) / 3600.0) % 24
    values = np.array([fc(now + a) for a in ahead])
    peak, night = values[np.argmin(np.abs(hours_of_day - 14))], values[np.argmin(np.abs(hours_of_day - 2))]
    assert peak > 3 * night and peak == pytest.approx(20 / 3600, rel=0.25)
    assert pool.replica_seconds_per_request == pytest.approx(2.0 / 4)  # mean stream 2 s over 4 slots


def test_short_history_means_no_forecast(tmp_path) -> None:
    store = tmp_path / "usage.duckdb"
    end = time.time() // 3600 * 3600
    with connect(store) as con:
        insert_events(con, _events(end, 30))
    assert forecasts_from_usage(store, [PoolConfig(PoolSpec("m", "1"))]) == {}
    assert forecasts_from_usage(tmp_path / "missing.duckdb", [PoolConfig(PoolSpec("m", "1"))]) == {}


def test_admission_queue_reports_batch_demand_to_the_controller() -> None:
    async def fill() -> AdmissionQueue:
        q = AdmissionQueue("m:1")
        loop = asyncio.get_running_loop()
        deadline_ms = (time.time() + 120) * 1000
        for i, (tier, deadline) in enumerate([("batch", deadline_ms), ("batch", None), ("interactive", None)]):
            q._enqueue(Ticket((2 if tier == "batch" else 0, deadline or math.inf, i), tier, lambda: None,
                              loop.create_future(), f"r{i}"))
        return q

    q = asyncio.run(fill())
    assert q.tier_counts() == {"interactive": 1, "standard": 0, "batch": 2}
    payload = {"replicas": [], "queues": {"m:1": {"waiting": 3, "by_tier": q.tier_counts(),
                                                  "batch_deadline_ms": q.earliest_deadline_ms("batch")}}}
    sig = parse_fleet(payload, "m", 0.5)
    assert sig.batch_waiting == 2 and 100 < sig.batch_deadline_s <= 120
    assert batch_demand(sig, 3.0) == pytest.approx(2 * 3.0 / sig.batch_deadline_s)
    assert batch_demand(replace(sig, batch_deadline_s=None), 3.0) == pytest.approx(6.0 / 600)
    assert batch_demand(Signals(model="m"), 3.0) == 0.0


def test_controller_adds_capacity_for_queued_batch_work() -> None:
    class OneReplica:  # an actuator with one serving replica that records what it is asked for
        calls: list[int] = []

        def counts(self, _spec) -> ReplicaCounts:
            return ReplicaCounts(serving=1)

        def scale(self, _spec, desired: int) -> None:
            self.calls.append(desired)

        def cold_start_s(self, _spec):
            return 30.0

    pool = PoolConfig(PoolSpec("m", "1"), min_replicas=1, max_replicas=4, replica_seconds_per_request=2.0)
    actuator = OneReplica()
    sig = Signals(model="m", serving=1, batch_waiting=200, batch_deadline_s=300.0)
    decision = Controller([pool], actuator, "http://unused", signal_reader=lambda _p: sig).tick(0.0)[0]
    assert decision.signals["batch_required"] == pytest.approx(200 * 2.0 / 300.0, abs=1e-3)
    assert actuator.calls and actuator.calls[-1] >= 2


def test_local_actuator_keeps_replicas_within_the_cpu_budget(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FLEET_ENGINE_THREADS", "2")
    settings = load_settings()
    assert engine_threads() == 2
    actuator = LocalActuator(settings, cpu_cores=2)
    assert actuator.max_replicas == 1  # 2 cores / 2 engine threads
    pool = PoolSpec("m", "1")
    spec = ReplicaSpec("m", "1", 0)
    actuator.replicas[spec.replica_id] = LocalReplica(spec, pool, state="serving")
    with caplog.at_level(logging.WARNING):
        actuator.scale(pool, 2)
    assert actuator.counts(pool).total == 1  # no second replica on the same two cores
    assert "CPU budget allows 0 more" in caplog.text
    assert LocalActuator(settings, cpu_cores=2, cpu_budget=False).max_replicas is None
    assert LocalActuator(settings, cpu_cores=8).max_replicas == 4
