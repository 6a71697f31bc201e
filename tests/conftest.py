"""Shared pytest fixtures: throwaway data dirs, the converted SmolLM2 weights, a real tansu broker,
real PostgreSQL databases. Every fixture starts real parts; none of them fake a service."""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.processes import StartupFailed, free_port, pid_alive, stop_pid, wait_until
from common.settings import Settings, load_settings
from common.services import start_tansu
from tests.integration.platform import Platform, platform_env
from tests.observability.otlp_receiver import OtlpReceiver

# The suite runs many replicas, routers and clients on a few cores at once: replicas never spin-wait
# (common.vendor.replica_cores; tests/autoscale/test_replica_cores.py covers `auto`).
os.environ.setdefault("FLEET_REPLICA_CPU_CORES", "shared")
# every replica a test starts runs the engine's warm-up before it is ready (python_backends/engine/warmup.py);
# a 2-sequence one keeps the suite's dozens of replica starts cheap, tests/engine/test_triton_engine.py runs
# the full default burst
os.environ.setdefault("FLEET_ENGINE_WARMUP_SEQS", "2")
PG_ADMIN_DSN = os.environ.get("FLEET_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-data")


@pytest.fixture(scope="session")
def settings(data_dir: Path) -> Settings:
    """Settings on a throwaway data dir; vendor binaries and the weights cache stay shared."""
    os.environ["FLEET_DATA_DIR"] = str(data_dir)
    return load_settings()


@pytest.fixture(scope="session")
def smollm2_dir(settings: Settings) -> Path:
    """SmolLM2-135M-Instruct converted once to bf16 safetensors (cached across runs)."""
    from build_engines.cpu import smollm2_weights

    return smollm2_weights(settings.cache_dir)


@pytest.fixture(scope="session")
def kafka_bootstrap(settings: Settings, data_dir: Path) -> Iterator[str]:
    """A real tansu (Kafka-protocol) broker on a free port, for the whole session."""
    port = free_port()
    proc = start_tansu(settings, port, data_dir / "logs" / f"tansu-{port}.log")
    yield f"127.0.0.1:{port}"
    stop_pid(proc.pid)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.sqlite'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh database on the machine's real PostgreSQL, dropped afterwards."""
    import psycopg

    name = f"fleet_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = psycopg.connect(PG_ADMIN_DSN, autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_DSN}: {exc}")
    admin.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    from registry.db import _engines
    for url in [u for u in _engines if u.endswith(name)]:
        _engines.pop(url).dispose()
    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Run a registry test on SQLite and on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/gRPC trace receiver the session's platform exports its spans to."""
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def platform(tmp_path_factory, otlp_receiver):
    """One `fleet up` per test session (it costs ~40 s), and `fleet down` at the end, which must leave no
    process behind. Traces go to the session's OTLP receiver and logs are JSON (tests/observability)."""
    data_dir = tmp_path_factory.mktemp("platform")
    env = platform_env(data_dir)
    env.update(FLEET_OTLP_ENDPOINT=otlp_receiver.endpoint, FLEET_LOG_FORMAT="json",  # the block's base + 5 is free:
               FLEET_USAGE_METRICS_PORT=str(int(env["FLEET_ROUTER_HTTP_PORT"]) + 5))  # common.processes
    p = Platform(env, data_dir)
    up = p.fleet("up")
    assert up.returncode == 0, f"fleet up failed:\n{up.stdout}\n{up.stderr}"
    assert "API key" in up.stdout and p.api_key in up.stdout
    pids = [json.loads(f.read_text())["pid"] for f in (data_dir / "run").glob("*.json")]
    assert len(pids) >= 5, "expected broker, loader, replica, router and UI processes"
    p.wait_serving()
    yield p
    down = p.fleet("down")
    assert down.returncode == 0, down.stderr
    try:  # `fleet down` waits for each leader; a stub may need a moment to be reaped
        wait_until(lambda: not [pid for pid in pids if pid_alive(pid)] and not _group_members(set(pids)), 15,
                   "platform processes gone")
    except StartupFailed:
        pass
    assert not [pid for pid in pids if pid_alive(pid)], "fleet down left processes behind"
    assert not _group_members(set(pids)), "fleet down left child processes (e.g. backend stubs) behind"


def _group_members(groups: set[int]) -> list[int]:
    """Live processes whose process group is one that `fleet up` started."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out.append(int(stat.parent.name))
    return out


