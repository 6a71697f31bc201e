"""Start the whole platform with `fleet up` on free ports and a throwaway data dir, as a user would."""
from __future__ import annotations

import os
import queue
import random
import time
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from common.processes import port_open
from common.settings import REPO_ROOT


def _free_block(size: int) -> int:
    for _ in range(200):
        base = random.randrange(20000, 40000, 10)
        if not any(port_open("127.0.0.1", base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block")


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


def platform_env(data_dir: Path) -> dict[str, str]:
    base = _free_block(40)
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(FLEET_DATA_DIR=str(data_dir), FLEET_ROUTER_HTTP_PORT=str(base), FLEET_ROUTER_GRPC_PORT=str(base + 1),
               FLEET_ADMIN_UI_PORT=str(base + 2), FLEET_KAFKA_PORT=str(base + 3),
               FLEET_REPLICA_BASE_PORT=str(base + 10),
               FLEET_METRICS_SCRAPE_S="2",  # the Fleet history fills within seconds
               FLEET_AUTOSCALER="off")  # tests that kill or count replicas must not race a live autoscaler
    return env
