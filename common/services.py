"""How each platform service is started: the exact command lines, used by `fleet up` and by the tests."""
from __future__ import annotations

import logging
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from common.processes import port_open, spawn, wait_until
from common.settings import Settings
from common.vendor import replica_cores, tansu_binary, triton_env, triton_home

log = logging.getLogger(__name__)


def start_tansu(settings: Settings, port: int, log_path: Path) -> subprocess.Popen:
    """The embedded Kafka-compatible broker; memory storage, so data lives as long as the process."""
    url = f"tcp://127.0.0.1:{port}"
    proc = spawn([str(tansu_binary(settings)), "broker", "--listener-url", url, "--advertised-listener-url", url,
                  "--storage-engine", "memory://tansu/"], log_path)
    wait_until(lambda: port_open("127.0.0.1", port), 20, "tansu broker", proc, log_path)
    return proc


def replica_ports(base_port: int) -> tuple[int, int, int]:
    """(http, grpc, metrics) ports of the replica whose block starts at base_port."""
    return base_port, base_port + 1, base_port + 2


def triton_ready(http_port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as resp:
        return resp.status == 200


def start_triton(settings: Settings, repository: Path, base_port: int, log_path: Path,
                 extra_env: dict[str, str] | None = None, timeout_s: float = 180,
                 on_spawn: Callable[[subprocess.Popen], None] | None = None) -> subprocess.Popen:
    """One `tritonserver` replica on (http, grpc, metrics) = base_port, +1, +2, bound to `settings.replica_bind`
    (FLEET_REPLICA_BIND, 127.0.0.1 by default); waits until ready.

    `on_spawn` runs right after the process exists (before it is ready), so a supervisor can record it
    and stop it even if whoever started it goes away during the model load."""
    home = triton_home(settings)
    http, grpc, metrics = replica_ports(base_port)
    cores = replica_cores(settings.replica_cpu_cores)
    env = triton_env(settings, cores)
    env.update(extra_env or {})
    bind = settings.replica_bind  # loopback locally: only the router (and tests) reach a replica
    cmd = [str(home / "bin" / "tritonserver"), f"--model-repository={repository}",
           f"--backend-directory={home / 'backends'}", f"--http-port={http}", f"--grpc-port={grpc}",
           f"--metrics-port={metrics}", f"--http-address={bind}", f"--grpc-address={bind}",
           f"--metrics-address={bind}", "--allow-sagemaker=false", "--allow-vertex-ai=false",
           "--exit-timeout-secs=5", "--log-verbose=0", "--strict-readiness=true",
           # Triton's own latency histograms (nv_inference_first_response_histogram_ms): docs/observability.md
           "--metrics-config=histogram_latencies=true"]
    proc = spawn(cmd, log_path, env=env)
    log.info("tritonserver on %d: %s CPU cores (replica_cpu_cores=%s)", http, cores, settings.replica_cpu_cores)
    if on_spawn is not None:
        on_spawn(proc)
    wait_until(lambda: triton_ready(http), timeout_s, f"tritonserver on {http}", proc, log_path)
    return proc


def python_module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
