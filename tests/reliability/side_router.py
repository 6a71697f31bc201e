"""A second real router process in front of a RouterStack's replicas (the same registry), on its own ports and
with its own router settings: for tests that stop a router, or need a small admission capacity, without
restarting the stack's router. It gets no replica state reports (the replicas report to the stack's router),
so it places round-robin and counts only its own streams against FLEET_ROUTER_REPLICA_CONCURRENCY."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from common import processes
from common.settings import REPO_ROOT
from tests.integration.platform import router_fleet
from tests.integration.router_stack import RouterStack


@dataclass
class SideRouter:
    proc: subprocess.Popen
    http_url: str
    grpc_url: str
    http_port: int
    log: Path
    admin_token: str

    @classmethod
    def start(cls, stack: RouterStack, log: Path, **router_env: str) -> "SideRouter":
        http_port, grpc_port, internal_port = processes.free_port(), processes.free_port(), processes.free_port()
        proc = processes.spawn([sys.executable, "-m", "router_service", "--no-usage", "--http-port", str(http_port),
                                "--grpc-port", str(grpc_port), "--internal-port", str(internal_port)],
                               log, env={**stack.env, **router_env}, cwd=REPO_ROOT)
        side = cls(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", http_port, log, stack.admin_token)
        try:
            processes.wait_until(lambda: httpx.get(f"{side.http_url}/health", timeout=1).status_code == 200, 60,
                                 "second router", proc, log)
        except BaseException:
            side.stop()
            raise
        return side

    def fleet(self) -> dict:
        return router_fleet(self.http_url, self.admin_token)

    def waiting(self) -> int:
        return sum(q["waiting"] for q in self.fleet()["queues"].values())

    def inflight(self) -> int:
        return sum(r["inflight"] for r in self.fleet()["replicas"])

    def serving(self) -> int:
        return sum(r["state"] == "serving" for r in self.fleet()["replicas"])

    def stop(self) -> None:
        processes.stop_pid(self.proc.pid)
