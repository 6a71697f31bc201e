"""Signals from the router's /admin/fleet (a real HTTP server) and the controller loop's decisions."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.controller import Controller, PoolConfig
from autoscale.signals import Signals, parse_fleet, read_signals, replica_inflight

FLEET = {
    "replicas": [
        {"replica_id": "r1", "model": "smollm2", "version": "1", "state": "serving", "inflight": 3,
         "kv_blocks_total": 100, "kv_blocks_free": 40, "running": 6, "waiting": 2, "ttft_ms_p95": 320.0,
         "queue_wait_ms_p95": 40.0, "tokens_per_s": 150.0},
        {"replica_id": "r2", "model": "smollm2", "version": "1", "draining": True, "inflight": 0,
         "kv_blocks_total": 100, "kv_blocks_free": 100},
        {"replica_id": "x1", "model": "other", "version": "1", "kv_blocks_total": 10, "kv_blocks_free": 0},
    ],
    "models": {"smollm2": {"queued": 4, "queue_wait_ms_p95": 120.0, "requests_per_s": 2.5}},
}


@pytest.fixture
def router_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(FLEET).encode()
            self.send_response(200 if self.path == "/admin/fleet" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_read_signals_aggregates_serving_replicas(router_url: str) -> None:
    sig = read_signals(router_url, "smollm2", slo_ttft_s=0.5, capacity_tokens_per_s=300.0)
    assert sig.serving == 1  # the draining replica does not count
    assert sig.kv_utilisation == pytest.approx(0.6)
    assert (sig.running, sig.waiting) == (6, 2 + 4)
    assert sig.ttft_p95_s == pytest.approx(0.32) and sig.ttft_ratio == pytest.approx(0.64)
    assert sig.queue_wait_p95_s == pytest.approx(0.12)
    assert sig.load == pytest.approx(0.5)
    assert replica_inflight(router_url, "r1") == 3 and replica_inflight(router_url, "r2") == 0
    assert replica_inflight(router_url, "missing") is None


def test_parse_fleet_reads_the_routers_model_version_queues() -> None:
    payload = {"replicas": [{"replica_id": "a", "model": "m", "version": "1", "state": "serving", "running": 1},
                            {"replica_id": "b", "model": "m", "version": "1", "state": "cordoned", "running": 5}],
               "queues": {"m:1": {"waiting": 3, "retry_after_ms": 200}, "m:2": {"waiting": 1}, "other:1": {"waiting": 9}}}
    sig = parse_fleet(payload, "m", 0.5)
    assert sig.serving == 1 and sig.running == 1 and sig.waiting == 4


def test_parse_fleet_accepts_nested_state_and_pool_lists() -> None:
    payload = {"replicas": [{"replica_id": "a", "model": "m", "state": {"running": 2, "kv_blocks_total": 8,
                                                                        "kv_blocks_free": 2}}],
               "pools": [{"model": "m", "queue_wait_ms_p95": 900}]}
    sig = parse_fleet(payload, "m", 0.5)
    assert sig.running == 2 and sig.kv_utilisation == pytest.approx(0.75) and sig.queue_wait_p95_s == pytest.approx(0.9)


class RecordingActuator:
    """In-memory actuator with the Actuator interface: replicas start after `cold_s` controller seconds."""

    def __init__(self, cold_s: float = 10.0) -> None:
        self.cold_s, self.now = cold_s, 0.0
        self.replicas: list[float] = [0.0]  # ready times
        self.calls: list[int] = []

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        ready = sum(t <= self.now for t in self.replicas)
        return ReplicaCounts(serving=ready, starting=len(self.replicas) - ready)

    def scale(self, pool: PoolSpec, desired: int) -> None:
        self.calls.append(desired)
        while len(self.replicas) < desired:
            self.replicas.append(self.now + self.cold_s)
        while len(self.replicas) > desired:
            self.replicas.pop()

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        return self.cold_s


def test_controller_scales_up_on_a_load_step_and_drains_slowly(tmp_path) -> None:
    pool = PoolConfig(PoolSpec("smollm2", "1"), min_replicas=1, max_replicas=4, max_running_per_replica=8, target_load=0.7)
    actuator = RecordingActuator()
    load = {"running": 2.0}

    def reader(_pool: PoolConfig) -> Signals:
        return Signals(model="smollm2", serving=actuator.counts(pool.spec).serving, running=load["running"])

    decisions = tmp_path / "decisions.jsonl"
    ctl = Controller([pool], actuator, "http://unused", interval_s=2.0, signal_reader=reader, decisions_path=decisions)
    for step in range(5):
        actuator.now = step * 2.0
        ctl.tick(actuator.now)
    assert actuator.calls == []  # 2 running of 8 slots: 1 replica is enough
    load["running"] = 8.0  # 4x step: slots full
    actuator.now = 10.0
    ctl.tick(10.0)
    assert actuator.calls and actuator.calls[-1] >= 2  # second replica requested at once
    load["running"] = 2.0  # back to 1x
    for step in range(6, 200):
        actuator.now = step * 2.0
        ctl.tick(actuator.now)
    assert actuator.calls[-1] == 1  # drained back down, after the cooldown
    downs = [b for a, b in zip(actuator.calls, actuator.calls[1:]) if b < a]
    assert all(a - b == 1 for a, b in zip(actuator.calls, actuator.calls[1:]) if b < a) and downs
    recorded = [json.loads(line) for line in decisions.read_text().splitlines()]  # what the admin UI shows
    assert [r["reason"] for r in recorded][:1] == ["scale up"] and recorded[-1]["reason"] == "scale down (drain)"
    assert len(recorded) == len(actuator.calls) and recorded[0]["signals"]["running"] == 8.0
