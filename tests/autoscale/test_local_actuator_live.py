"""Local actuator on real replicas: router + Triton (SmolLM2 CPU engine) from tests/integration/router_stack.

Scale 1 -> 2 (a real tritonserver starts, is registered, reports to the router, its cold start is
measured), then 2 -> 1 while a stream is open: the replica is marked draining, the router stops
admitting, the stream finishes, then the process stops and its registry row is deleted.
"""
from __future__ import annotations

import threading

import httpx
import pytest

from autoscale.actuators import PoolSpec
from autoscale.actuators.local import LocalActuator
from common import processes
from common.processes import wait_until
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION
from registry.db import session_scope
from registry.queries import list_replicas

pytestmark = pytest.mark.integration


def _stream(stack, out: dict) -> None:
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": 48, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{stack.http_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {stack.api_key}"}) as resp:
        out["status"] = resp.status_code
        out["lines"] = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out["lines"].append(line)  # a first line: the router admitted it and the replica streams


def test_local_actuator_starts_and_drains_real_replicas(tmp_path) -> None:
    from tests.integration.router_stack import RouterStack

    stack = RouterStack.start(tmp_path / "stack", replicas=1)
    # cpu_budget=False: this test is about starting and draining real replicas, so the second one may share
    # the cores (told explicitly); the budget itself is tested in test_live_inputs.py.
    actuator = LocalActuator(stack.settings, [stack.http_url], admin_token=stack.admin_token, drain_timeout_s=90,
                             cpu_budget=False)
    pool = PoolSpec(DEFAULT_MODEL, DEFAULT_VERSION, stack.settings.region)
    try:
        actuator.adopt(pool)
        assert actuator.counts(pool).serving == 1
        actuator.scale(pool, 2)
        assert actuator.counts(pool).starting == 1
        wait_until(lambda: actuator.counts(pool).serving == 2 or actuator.events[-1]["event"] == "failed", 240,
                   "the second replica serving")
        assert actuator.counts(pool).serving == 2, actuator.events
        new_id = f"{DEFAULT_MODEL}-v{DEFAULT_VERSION}-r1"
        stack.wait_serving([new_id])
        assert actuator.cold_start_s(pool) is not None
        with session_scope(stack.settings.db_url) as s:
            assert {r.replica_id: r.state for r in list_replicas(s, DEFAULT_MODEL)}[new_id] == "serving"

        streams = [dict() for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(stack, out)) for out in streams]
        for t in threads:
            t.start()
        wait_until(lambda: all(out.get("lines") for out in streams), 120, "the three streams streaming")
        actuator.scale(pool, 1)  # drains the newest replica (r1)
        for t in threads:
            t.join(150)
        actuator.wait_idle(150)
        for out in streams:  # no stream failed: each got a final chunk and [DONE]
            assert out["status"] == 200 and out["lines"][-1] == "data: [DONE]", out
            assert '"finish_reason": "' in out["lines"][-2], out["lines"][-2]
        assert actuator.forced_stops == 0
        assert actuator.counts(pool).serving == 1
        with session_scope(stack.settings.db_url) as s:
            assert new_id not in {r.replica_id for r in list_replicas(s, DEFAULT_MODEL)}
        stopped = [e for e in actuator.events if e["event"] == "stopped"]
        assert stopped and stopped[0]["replica_id"] == new_id
        assert not any(p["alive"] for p in processes.running(stack.settings) if p.get("replica_id") == new_id)
    finally:
        actuator.stop_all()
        stack.stop()
