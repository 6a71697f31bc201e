"""The GPU serving path on CPU: the real router, real tritonserver replicas serving the GPU ensemble (real GPU
preprocessing/postprocessing, the stand-in `tensorrt_llm`), a state reporter beside each replica, a real tansu
broker for usage events. Free ports, a throwaway data dir."""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from build_engines.lora_convert import convert_peft
from build_engines.register import Registration
from common import processes
from autoscale.actuators.replicas import ReplicaSpec, replica_base_port, start_replica
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION, seed
from common.report_channel import load_report_secret, replica_key
from common.services import replica_ports, start_tansu
from common.settings import REPO_ROOT, Settings, load_settings
from common.vendor import triton_home
from registry.db import migrate
from tests.gpu.standin_repo import render_standin_repository
from tests.integration.platform import platform_env


@dataclass
class GpuStack:
    env: dict[str, str]
    settings: Settings
    api_key: str
    admin_token: str
    kafka: str
    procs: list = field(default_factory=list)
    replica_ids: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, data_dir: Path, checkpoint: Path, replicas: int = 2, lora_cache_tasks: int = 1) -> "GpuStack":
        env = platform_env(data_dir)
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            settings = load_settings()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        migrate(settings.db_url)
        adapters = settings.data_dir / "adapters"
        repo = render_standin_repository(checkpoint, settings.data_dir / "engines" / DEFAULT_MODEL / DEFAULT_VERSION /
                                         "model_repository", adapters, DEFAULT_MODEL, DEFAULT_VERSION, lora_cache_tasks)
        reg = Registration(settings.db_url, DEFAULT_MODEL, DEFAULT_VERSION)
        reg.begin(weights_uri=str(checkpoint), dtype="bf16", tensor_parallel=1, max_context=2048,
                  engine_kind="trtllm", repository_path="", build_info={"note": "stand-in tensorrt_llm (tests)"})
        reg.update("staged", repository_path=str(repo))
        api_key, admin_token = seed(settings)  # routes the version, installs + registers the PEFT adapters
        for folder in sorted(p for p in adapters.iterdir() if (p / "adapter_config.json").exists()):
            convert_peft(folder, folder)  # what build-engines does for a LoRA engine
        stack = cls(env, settings, api_key, admin_token, "")
        try:
            port = processes.free_port()
            stack.procs.append(start_tansu(settings, port, settings.logs_dir / "tansu.log"))
            stack.kafka = f"127.0.0.1:{port}"
            stack._start_router()
            triton_home(settings)
            for i in range(replicas):
                stack.add_replica(i)
        except BaseException:
            stack.stop()
            raise
        return stack

    @property
    def http_url(self) -> str:
        return self.settings.router_http_url

    def _start_router(self) -> None:
        log = self.settings.logs_dir / "router.log"
        proc = processes.spawn([sys.executable, "-m", "router_service", "--kafka", self.kafka], log, env=self.env,
                               cwd=REPO_ROOT)
        self.procs.append(proc)
        processes.wait_until(lambda: _ok(f"{self.http_url}/health"), 60, "router", proc, log)

    def metrics_url(self, index: int) -> str:
        return f"http://127.0.0.1:{replica_ports(replica_base_port(self.settings, index))[2]}/metrics"

    def add_replica(self, index: int) -> None:
        spec = ReplicaSpec(DEFAULT_MODEL, DEFAULT_VERSION, index)
        start_replica(self.settings, spec)
        # like every replica: reports go to the router's internal listener, signed with this replica's key
        key = replica_key(load_report_secret(self.settings), spec.replica_id)
        env = dict(self.env, FLEET_REPLICA_ID=spec.replica_id, FLEET_MODEL=DEFAULT_MODEL,
                   FLEET_VERSION=DEFAULT_VERSION, FLEET_ROUTER_URLS=self.settings.router_internal_url,
                   FLEET_REPORT_KEY=key)
        self.procs.append(processes.spawn(
            [sys.executable, "-m", "python_backends.trtllm_state", "--metrics-url", self.metrics_url(index),
             "--interval", "0.2"], self.settings.logs_dir / f"reporter-{index}.log", env=env, cwd=REPO_ROOT))
        self.replica_ids.append(spec.replica_id)

    def fleet(self) -> dict:
        return httpx.get(f"{self.http_url}/admin/fleet", headers={"authorization": f"Bearer {self.admin_token}"},
                         timeout=5).json()

    def complete(self, prompt: str, max_tokens: int, adapter: str = "", **extra) -> dict:
        body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        if adapter:
            body["adapter"] = adapter
        resp = httpx.post(f"{self.http_url}/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {self.api_key}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def replica_metric(self, index: int, name: str) -> float:
        """Sum of a metric family's samples on replica `index` (0 when absent)."""
        text = httpx.get(self.metrics_url(index), timeout=5).text
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def router_metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.http_url}/metrics", timeout=5).text
        total = 0.0
        for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def stop(self) -> None:
        for proc in reversed(self.procs):
            processes.stop_pid(proc.pid)
        for info in processes.running(self.settings):
            if info["alive"]:
                processes.stop(self.settings, info["name"])


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)
