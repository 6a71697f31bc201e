"""Start the whole platform with `fleet up` on free ports and a throwaway data dir, as a user would."""
from __future__ import annotations

import os
import queue
import time
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from common.processes import throwaway_platform_env, wait_until
from common.settings import REPO_ROOT


@dataclass
class Platform:
    env: dict[str, str]
    data_dir: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.env['FLEET_ROUTER_GRPC_PORT']}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.env['FLEET_ROUTER_HTTP_PORT']}"

    @property
    def api_key(self) -> str:
        return (self.data_dir / "dev-api-key").read_text().strip()

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin-token").read_text().strip()

    def stream(self, text: str, model: str = "smollm2-135m", max_tokens: int = 24, key: str | None = None,
               **params) -> list:
        """One greedy streamed request through the router; returns every InferResult (raises on error)."""
        headers = {"authorization": f"Bearer {key if key is not None else self.api_key}"}
        return stream_completion(self.grpc_url, text, model, max_tokens, headers, **params)

    def wait_serving(self, timeout_s: float = 60) -> dict:
        return wait_replicas_serving(self.http_url, self.admin_token, None, timeout_s)

    def fleet(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleet.cli", *args], env=self.env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout)


def stream_completion(grpc_url: str, text: str, model: str, max_tokens: int = 24, headers: dict | None = None,
                      **params) -> list:
    """One greedy request over stock tritonclient gRPC streaming (router or replica); every InferResult."""
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("max_tokens", [1], "INT32"),
              grpcclient.InferInput("temperature", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([text.encode()], dtype=object))
    inputs[1].set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([0.0], dtype=np.float32))
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    client.async_stream_infer(model, inputs, request_id=f"test-{time.time_ns()}", parameters=params or None)
    out = []
    try:
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            out.append(result)
            if result.as_numpy("finish_reason")[0]:
                return out
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def router_fleet(http_url: str, admin_token: str) -> dict:
    """The router's own view (`GET /admin/fleet`): replicas as in its registry snapshot, with their reports."""
    import httpx
    return httpx.get(f"{http_url}/admin/fleet", headers={"authorization": f"Bearer {admin_token}"}, timeout=5).json()


def wait_replicas_serving(http_url: str, admin_token: str, replica_ids: list[str] | None = None,
                          timeout_s: float = 60) -> dict:
    """Until the router would route to the replicas: `serving` in its registry snapshot (not cordoned) and
    reporting state; `None` = at least one replica. Tests wait on this, never on a sleep or on the first
    state report (a replica reports before the router's registry reload makes it serving)."""
    def ready() -> dict | None:
        fleet = router_fleet(http_url, admin_token)
        seen = {r["replica_id"]: r for r in fleet["replicas"] if r["state"] == "serving" and r.get("reporting")}
        wanted = replica_ids if replica_ids is not None else list(seen)[:1] or ["any replica"]
        return fleet if all(rid in seen for rid in wanted) else None
    return wait_until(ready, timeout_s, f"replicas {replica_ids or 'any'} serving in the router's snapshot")


def platform_env(data_dir: Path) -> dict[str, str]:
    # autoscaler off (in throwaway_platform_env): tests that kill or count replicas must not race it
    return {**throwaway_platform_env(data_dir), "FLEET_METRICS_SCRAPE_S": "2"}  # the Fleet history fills within seconds
