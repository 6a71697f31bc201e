"""A router in front of N real Triton replicas (real SmolLM2 engine), without Kafka or the admin UI:
what the router's integration tests and bench/router need. Ports are free ones; the data dir is a
throwaway one; replicas start in parallel."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import processes
from autoscale.actuators.replicas import ReplicaSpec, start_replica
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION, seed
from common.vendor import triton_home
from common.settings import REPO_ROOT, Settings, load_settings
from registry.db import migrate
from tests.integration.platform import platform_env, router_fleet, wait_replicas_serving


@contextmanager
def _environ(env: dict[str, str]):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class RouterStack:
    env: dict[str, str]
    settings: Settings
    api_key: str
    admin_token: str
    replica_ids: list[str] = field(default_factory=list)
    router: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return self.settings.router_http_url

    @property
    def grpc_url(self) -> str:
        return self.settings.router_grpc_url

    @classmethod
    def start(cls, data_dir: Path, replicas: int = 2, engine_env: dict[str, str] | None = None,
              router_env: dict[str, str] | None = None, router_args: tuple[str, ...] = ("--no-usage",)) -> "RouterStack":
        env = platform_env(data_dir)
        env.update(router_env or {})
        with _environ(env):
            settings = load_settings()
        migrate(settings.db_url)
        subprocess.run([sys.executable, "-m", "build_engines.cli", "--model", DEFAULT_MODEL, "--version",
                        DEFAULT_VERSION, "--checkpoint", "smollm2", "--target", "cpu"], check=True, cwd=REPO_ROOT,
                       env=env, capture_output=True)
        api_key, admin_token = seed(settings)
        stack = cls(env, settings, api_key, admin_token)
        try:
            stack.start_router(router_args)
            stack.add_replicas(range(replicas), engine_env)
        except BaseException:
            stack.stop()
            raise
        return stack

    def start_router(self, args: tuple[str, ...]) -> None:
        log = self.settings.logs_dir / "router.log"
        self.router = processes.spawn([sys.executable, "-m", "router_service", *args], log, env=self.env, cwd=REPO_ROOT)
        processes.wait_until(lambda: _ok(f"{self.http_url}/health"), 60, "router", self.router, log)

    def restart_router(self, extra_env: dict[str, str], args: tuple[str, ...] = ("--no-usage",)) -> None:
        """Restart the router with more env (e.g. another FLEET_ROUTER_POLICY); waits until replicas serve."""
        if self.router is not None:
            processes.stop_pid(self.router.pid)
        self.env.update(extra_env)
        self.start_router(args)
        self.wait_serving(self.replica_ids)

    def add_replicas(self, indexes, engine_env: dict[str, str] | None = None) -> None:
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                start_replica(self.settings, ReplicaSpec(DEFAULT_MODEL, DEFAULT_VERSION, i), engine_env)
            except BaseException as exc:  # reported below
                errors.append(exc)
        indexes = list(indexes)
        all_indexes = list(indexes)
        triton_home(self.settings)  # install tritonserver into the data dir once, before parallel starts
        threads = [threading.Thread(target=one, args=(i,)) for i in indexes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        started = [ReplicaSpec(DEFAULT_MODEL, DEFAULT_VERSION, i).replica_id for i in all_indexes]
        self.replica_ids = sorted({*self.replica_ids, *started})
        self.wait_serving(started)

    def fleet(self) -> dict:
        return router_fleet(self.http_url, self.admin_token)

    def wait_serving(self, replica_ids, timeout_s: float = 60) -> dict:
        """Until the router has the replicas `serving` in its registry snapshot and fresh state reports."""
        return wait_replicas_serving(self.http_url, self.admin_token, list(replica_ids), timeout_s)

    def replica_pid(self, replica_id: str) -> int:
        path = self.settings.run_dir / f"replica-{replica_id}.json"
        return json.loads(path.read_text())["pid"]

    def metrics(self) -> str:
        return httpx.get(f"{self.http_url}/metrics", timeout=5).text

    def stop(self) -> None:
        if self.router is not None:
            processes.stop_pid(self.router.pid)
        groups = [info["pid"] for info in processes.running(self.settings)]
        for info in processes.running(self.settings):
            if info["alive"]:
                processes.stop(self.settings, info["name"])
        for pgid in groups:  # stop_pid returns once the leader exits; Python-backend stubs may linger
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
