"""`fleet up` / `fleet down` / `fleet status`: the whole local platform on embedded defaults.

Order of start: registry migration and seed, engine build (cached), Kafka broker (tansu), usage loader,
one Triton replica, the routers (`--routers N` / FLEET_ROUTERS: N processes sharing the callers' ports through
SO_REUSEPORT, docs/router.md "Several routers"), metrics scraper, autoscaler (unless FLEET_AUTOSCALER=off), admin UI.
Each step is skipped when already running, so `up` is re-runnable.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.request

from rich.console import Console
from rich.table import Table

from common import processes
from autoscale.actuators.replicas import ReplicaSpec, start_replica, stop_replica
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION, seed
from common.services import start_tansu
from common.settings import REPO_ROOT, Settings
from registry.db import migrate

log = logging.getLogger(__name__)
console = Console()


def _alive(settings: Settings, name: str) -> bool:
    return any(p["name"] == name and p["alive"] for p in processes.running(settings))


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as resp:
        return resp.status == 200


def child_env(settings: Settings) -> dict[str, str]:
    """The environment of the processes `up` starts: this one's, with the router count `up` was given."""
    return {**dict(os.environ), "FLEET_ROUTERS": str(settings.routers)}


def _start(settings: Settings, name: str, cmd: list[str], health, what: str, timeout_s: float = 60,
           info: dict | None = None) -> None:
    if _alive(settings, name):
        console.print(f"  [green]✓[/] {what} already running")
        return
    log_path = settings.logs_dir / f"{name}.log"
    proc = processes.spawn(cmd, log_path, env=child_env(settings), cwd=REPO_ROOT)
    processes.wait_until(health, timeout_s, what, proc, log_path)
    processes.record(settings, name, proc, info or {})
    console.print(f"  [green]✓[/] {what} started (pid {proc.pid}, log {log_path})")


def build_default_engine(settings: Settings) -> None:
    cmd = [sys.executable, "-m", "build_engines.cli", "--model", DEFAULT_MODEL, "--version", DEFAULT_VERSION,
           "--checkpoint", "smollm2", "--target", "cpu"]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def up(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    with console.status("migrating the registry"):
        migrate(settings.db_url)
    console.print(f"  [green]✓[/] registry at {settings.db_url}")
    build_default_engine(settings)
    api_key, admin_token = seed(settings)
    if not settings.kafka_is_external and not _alive(settings, "kafka"):
        proc = start_tansu(settings, settings.kafka_port, settings.logs_dir / "kafka.log")
        processes.record(settings, "kafka", proc, {"kind": "kafka", "port": settings.kafka_port})
        console.print(f"  [green]✓[/] Kafka broker (tansu) on {settings.kafka_bootstrap}")
    _start(settings, "usage-loader", [sys.executable, "-m", "fleet.cli", "usage", "load"],
           lambda: True, "usage loader (Kafka -> DuckDB)", info={"kind": "loader"})
    with console.status("starting the Triton replica (loads the model)"):
        start_replica(settings, ReplicaSpec(DEFAULT_MODEL, DEFAULT_VERSION, 0))
    console.print("  [green]✓[/] Triton replica serving ensemble `llm`")
    start_routers(settings)
    _start(settings, "metrics-scraper", [sys.executable, "-m", "fleet.cli", "usage", "scrape-metrics"], lambda: True,
           "metrics scraper (every router's /metrics -> usage store; automatic rollback rules)",
           info={"kind": "metrics-scraper"})
    if settings.autoscaler:
        _start(settings, "autoscaler", [sys.executable, "-m", "fleet.cli", "autoscale", "run"], lambda: True,
               "autoscaler (local actuator)", info={"kind": "autoscaler"})
    ui = f"http://127.0.0.1:{settings.admin_ui_port}"
    _start(settings, "admin-ui", [sys.executable, "-m", "streamlit", "run", str(REPO_ROOT / "admin_ui" / "app.py"),
                                  "--server.port", str(settings.admin_ui_port), "--server.address", "127.0.0.1",
                                  "--server.headless", "true", "--browser.gatherUsageStats", "false"],
           lambda: _http_ok(f"{ui}/_stcore/health"), "admin UI", timeout_s=90, info={"kind": "ui"})
    print_endpoints(settings, api_key)


def router_name(index: int) -> str:
    return "router" if index == 0 else f"router-{index}"


def start_routers(settings: Settings) -> None:
    """FLEET_ROUTERS router processes on the shared callers' ports, each healthy on its own internal listener."""
    for i, internal in enumerate(settings.router_internal_urls):
        _start(settings, router_name(i), [sys.executable, "-m", "router_service", "--index", str(i)],
               lambda url=internal: _http_ok(f"{url}/metrics") and _http_ok(f"{settings.router_http_url}/health"),
               f"router {i + 1} of {settings.routers}", info={"kind": "router", "index": i, "internal_url": internal})


def print_endpoints(settings: Settings, api_key: str) -> None:
    grpc_url, http_url = settings.router_grpc_url, settings.router_http_url
    console.print(f"""
[bold]The platform is up.[/]
  router gRPC (KServe v2)  {grpc_url}
  router HTTP (OpenAI)     {http_url}/v1   (metrics: {http_url}/metrics; {settings.routers} router(s) on these ports)
  admin UI                 http://127.0.0.1:{settings.admin_ui_port}   (token in {settings.admin_token_file})
  Kafka                    {settings.kafka_bootstrap}   topic {settings.usage_topic}
  API key                  {api_key}   (also in {settings.dev_api_key_file})

[bold]Try it:[/]
curl -N {http_url}/v1/chat/completions -H "Authorization: Bearer $(cat {settings.dev_api_key_file})" \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "{DEFAULT_MODEL}", "stream": true, "max_tokens": 32, "temperature": 0,
       "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

.venv/bin/python examples/triton_client.py --url {grpc_url} "What is the capital of France?"
""", highlight=False, soft_wrap=True)


def down(settings: Settings) -> None:
    # autoscaler first so it does not replace replicas being stopped; broker last so the loader can drain
    order = {"autoscaler": -1, "admin-ui": 0, "metrics-scraper": 0, "usage-loader": 3, "kafka": 4}
    rank = lambda p: 1 if p.get("kind") == "router" else order.get(p["name"], 2)  # noqa: E731
    for info in sorted(processes.running(settings), key=rank):
        if info.get("kind") == "replica":
            stop_replica(settings, info["replica_id"])
        else:
            processes.stop(settings, info["name"])
        console.print(f"  stopped {info['name']} (pid {info['pid']})")
    console.print("[green]all platform processes stopped[/]")


def status(settings: Settings) -> None:
    table = Table(title=f"fleet processes ({settings.run_dir})")
    for col in ("name", "pid", "alive", "details"):
        table.add_column(col)
    for info in processes.running(settings):
        details = ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("name", "pid", "alive"))
        table.add_row(info["name"], str(info["pid"]), "[green]yes[/]" if info["alive"] else "[red]no[/]", details)
    console.print(table)
