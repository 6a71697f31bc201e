"""A manager's rollout on real tritonserver replicas, with the live autoscaler (local actuator) running:
`build-engines --version 2 --target cpu`, rollout 20 % while requests keep flowing, rollback. No request
may fail: v2's share stays on v1 until the autoscaler's v2 replica is ready (v2 has no warm-buffer row, it
inherits v1's), then exactly the sessions the split sends to v2 are served by v2; after the rollback all
go to v1 again and the autoscaler drains v2's replica (no longer routed)."""
from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

import httpx
import pytest

from common import processes
from common.processes import wait_until
from fleet.seed import DEFAULT_MODEL
from common.settings import REPO_ROOT
from registry.db import session_scope
from registry.queries import get_model_version, list_replicas
from router_service.rollout import pick_version
from tests.integration.router_stack import RouterStack

pytestmark = pytest.mark.integration
SESSIONS = [f"user-{i}" for i in range(40)]


class Traffic:
    """Workers sending short requests in a loop (each with its own session key) until stopped."""

    def __init__(self, stack: RouterStack, workers: int = 3) -> None:
        self.stack, self.results, self._stop = stack, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]

    def _run(self, worker: int) -> None:
        headers = {"authorization": f"Bearer {self.stack.api_key}"}
        with httpx.Client(base_url=self.stack.http_url, headers=headers, timeout=300) as client:
            i = worker
            while not self._stop.is_set():
                session = SESSIONS[i % len(SESSIONS)]
                body = {"model": DEFAULT_MODEL, "max_tokens": 4, "temperature": 0, "session": session,
                        "messages": [{"role": "user", "content": f"Say hello to {session}."}]}
                try:
                    resp = client.post("/v1/chat/completions", json=body)
                    version = resp.json().get("system_fingerprint") if resp.status_code == 200 else resp.text
                    self.results.append((session, resp.status_code, version))
                except httpx.HTTPError as exc:
                    self.results.append((session, 0, repr(exc)))
                i += len(self.threads)

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(300)

    def failures(self) -> list:
        return [r for r in self.results if r[1] != 200]


def _admin(stack: RouterStack, method: str, path: str, body: dict | None = None) -> dict:
    resp = httpx.request(method, f"{stack.http_url}/admin{path}", json=body, timeout=30,
                         headers={"authorization": f"Bearer {stack.admin_token}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _v2_replicas(stack: RouterStack) -> list:
    with session_scope(stack.settings.db_url) as s:
        return [(r.replica_id, r.state) for r in list_replicas(s, DEFAULT_MODEL) if r.version == "2"]


def test_rollout_to_a_fresh_version_fails_no_request(tmp_path):
    stack = RouterStack.start(tmp_path / "stack", replicas=1)
    try:
        # one replica per version at most: the machine has two cores
        _admin(stack, "PUT", f"/warm-buffers/{DEFAULT_MODEL}/1", {"min_idle_replicas": 0, "min_replicas": 1,
                                                                    "max_replicas": 1, "slo_ttft_ms_p95": 30000,
                                                                    "slo_tokens_per_s": 1})
        build = subprocess.run([sys.executable, "-m", "build_engines.cli", "--model", DEFAULT_MODEL, "--version", "2",
                                "--checkpoint", "smollm2", "--target", "cpu"], cwd=REPO_ROOT, env=stack.env,
                               capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-3000:]
        with session_scope(stack.settings.db_url) as s:
            assert get_model_version(s, DEFAULT_MODEL, "2").status == "staged"
        log = stack.settings.logs_dir / "autoscaler.log"
        scaler = processes.spawn([sys.executable, "-m", "autoscale.cli", "autoscale", "run", "--interval-s", "1"],
                                 log, env=stack.env, cwd=REPO_ROOT)
        processes.record(stack.settings, "autoscaler", scaler, {"kind": "autoscaler"})  # stack.stop() stops it

        with Traffic(stack) as traffic:
            wait_until(lambda: len(traffic.results) >= 6, 300, "traffic flowing to v1")
            answer = _admin(stack, "POST", f"/models/{DEFAULT_MODEL}/rollout", {"version": "2", "percent": 20})
            assert answer["routes"] == {"1": 80, "2": 20}
            assert "v2: 0 of 1 replicas ready, 20 % pending" in answer["rollout"]["notes"], answer
            wait_until(lambda: _admin(stack, "GET", f"/models/{DEFAULT_MODEL}/rollout")["rollout"]["versions"][1]
                       ["ready"] == 1, 420, "the autoscaler's v2 replica serving in the router", log_path=log)
            ready_at = len(traffic.results)
            status = _admin(stack, "GET", f"/models/{DEFAULT_MODEL}/rollout")["rollout"]
            assert status["effective"] == {"1": 80.0, "2": 20.0}, status
            to_v2 = {s for s in SESSIONS if pick_version({"1": 80, "2": 20}, s) == "2"}
            assert to_v2, "some sessions land on v2"
            wait_until(lambda: sum(1 for s, code, v in traffic.results[ready_at:] if v == "2") >= 8, 300,
                       "v2 serving its sessions")
            rolled = _admin(stack, "POST", f"/models/{DEFAULT_MODEL}/rollback")
            assert rolled["routes"] == {"1": 100}
            back_at = len(traffic.results)
            wait_until(lambda: len(traffic.results) >= back_at + 10, 300, "traffic after the rollback")
            wait_until(lambda: not _v2_replicas(stack), 300, "the autoscaler drains v2 (no longer routed)",
                       log_path=log)
            wait_until(lambda: len(traffic.results) >= back_at + 15, 300, "traffic after the drain")

        assert traffic.failures() == [], traffic.failures()[:5]
        before = traffic.results[:6]
        assert {v for _, _, v in before} == {"1"}
        # once v2 served, each session went where the split sends it (the share moves only when ready)
        after_ready = traffic.results[ready_at:back_at]
        first_v2 = next(i for i, r in enumerate(after_ready) if r[2] == "2")
        settled = after_ready[first_v2 + len(traffic.threads):]
        assert {v for _, _, v in settled} == {"1", "2"}
        assert all((v == "2") == (s in to_v2) for s, _, v in settled), Counter((s in to_v2, v) for s, _, v in settled)
        after_drain = traffic.results[-5:]
        assert {v for _, _, v in after_drain} == {"1"}
        print(f"rollout: {len(traffic.results)} requests, none failed; served by version "
              f"{dict(Counter(v for _, _, v in traffic.results))}")
    finally:
        stack.stop()
