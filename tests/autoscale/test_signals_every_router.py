"""The autoscaler reads every router, not one: two real router processes (the same registry, one on 127.0.0.1 and
one on 127.0.0.2, the same port, as two router pods behind a headless Service), requests waiting in each one's
admission queue (the model's only replica is still `starting`), and `read_signals` on the one name that resolves
to both (the cluster DNS answer for a headless Service, as tests/deploy/test_state_sidecar.py gives it) counts
the waiting requests of both routers; one router's view counts only its own."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from autoscale.signals import read_signals
from common.processes import free_port, stop_pid, wait_until
from registry import queries
from tests.router.conftest import MODEL, seed_registry

ADMIN = "admin-token-for-the-autoscaler-test"


def _router(host: str, port: int, db_url: str, data_dir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, FLEET_DATA_DIR=str(data_dir), FLEET_ADMIN_TOKEN=ADMIN, FLEET_REPORT_SECRET="s",
               FLEET_ROUTER_START_WAIT_S="600")  # a stopping router refuses queued requests at once: no wait on them
    cmd = [sys.executable, "-m", "router_service", "--host", host, "--http-port", str(port), "--grpc-port",
           str(free_port()), "--internal-host", host, "--internal-port", str(free_port()), "--db-url", db_url,
           "--no-usage"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def two_routers(tmp_path, smollm2_dir):
    db_url = f"sqlite:///{tmp_path / 'registry.sqlite'}"
    keys: dict[str, str] = {}

    def extra(s) -> None:  # the model's one replica is starting: requests wait for it in the routers' queues
        queries.upsert_replica(s, "r-starting", model=MODEL, version="1", region="local", grpc_url="127.0.0.1:1",
                               http_url="http://127.0.0.1:1", state="starting")
        keys["caller"] = queries.create_caller(s, "c", "team-a")

    seed_registry(db_url, extra=extra, weights_uri=str(smollm2_dir))
    port = free_port()
    procs = [_router(host, port, db_url, tmp_path / f"router-{i}", tmp_path / f"router-{i}.log")
             for i, host in enumerate(("127.0.0.1", "127.0.0.2"))]
    try:
        for i, (host, proc) in enumerate(zip(("127.0.0.1", "127.0.0.2"), procs)):
            wait_until(lambda h=host: _up(h, port), timeout_s=120, what=f"router on {host}:{port}", proc=proc,
                       log_path=tmp_path / f"router-{i}.log")
        yield port, keys["caller"]
    finally:
        for proc in procs:
            stop_pid(proc.pid)


def _up(host: str, port: int) -> bool:
    try:
        return httpx.get(f"http://{host}:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_in_queue(host: str, port: int, key: str, n: int) -> list[threading.Thread]:
    def one() -> None:  # held in the queue until its 20 s deadline (the replica never starts)
        try:
            httpx.post(f"http://{host}:{port}/v1/completions", timeout=30, headers={"authorization": f"Bearer {key}"},
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "deadline_ms": 20_000})
        except httpx.HTTPError:
            pass
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_signals_count_the_queues_of_every_router_behind_the_name(two_routers, monkeypatch) -> None:
    port, key = two_routers
    _wait_in_queue("127.0.0.1", port, key, 1)
    _wait_in_queue("127.0.0.2", port, key, 2)
    real = socket.getaddrinfo

    def cluster_dns(host, *args, **kwargs):  # no cluster DNS here: a headless Service's answer, two router pods
        if host == "llm-router-pods":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.1", "127.0.0.2")]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", cluster_dns)
    one = lambda url: read_signals(url, MODEL, 0.5, admin_token=ADMIN, version="1")  # noqa: E731
    wait_until(lambda: one(f"http://llm-router-pods:{port}").waiting == 3, timeout_s=20,
               what="both routers' queued requests in the signals")
    assert one(f"http://127.0.0.2:{port}").waiting == 2  # one router's view: only its own share
