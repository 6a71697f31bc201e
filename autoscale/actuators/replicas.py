"""Local Triton replicas: start one for a model version (registered in the registry), stop one.

This is what `fleet up` and the local autoscaler actuator use on a single machine.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from common import processes
from common.report_channel import load_report_secret, replica_key
from common.services import replica_ports, start_triton
from common.settings import Settings
from registry import queries
from registry.db import session_scope

log = logging.getLogger(__name__)
PORTS_PER_REPLICA = 10


@dataclass(frozen=True)
class ReplicaSpec:
    model: str
    version: str
    index: int

    @property
    def replica_id(self) -> str:
        return f"{self.model}-v{self.version}-r{self.index}"


def replica_base_port(settings: Settings, index: int) -> int:
    return settings.replica_base_port + PORTS_PER_REPLICA * index


def repository_for(settings: Settings, model: str, version: str) -> Path:
    with session_scope(settings.db_url) as s:
        row = queries.get_model_version(s, model, version)
        if row is None or not row.repository_path:
            raise RuntimeError(f"{model} version {version} is not built; run build-engines first")
        return Path(row.repository_path)


def start_replica(settings: Settings, spec: ReplicaSpec, extra_env: dict[str, str] | None = None) -> float:
    """Start tritonserver for spec, wait until ready, mark it serving. Returns the cold-start seconds."""
    base = replica_base_port(settings, spec.index)
    http, grpc, metrics = replica_ports(base)
    name = f"replica-{spec.replica_id}"
    if any(p["name"] == name and p["alive"] for p in processes.running(settings)):
        log.info("%s already running", spec.replica_id)
        return 0.0
    repository = repository_for(settings, spec.model, spec.version)
    common = dict(model=spec.model, version=spec.version, region=settings.region,
                  grpc_url=f"127.0.0.1:{grpc}", http_url=f"http://127.0.0.1:{http}",
                  metrics_url=f"http://127.0.0.1:{metrics}/metrics")
    with session_scope(settings.db_url) as s:
        queries.upsert_replica(s, spec.replica_id, state="starting", pid=0, **common)
    # reports go to the router's internal listener, signed with a key that speaks for this replica only
    key = replica_key(load_report_secret(settings), spec.replica_id)
    env = {"FLEET_REPLICA_ID": spec.replica_id, "FLEET_MODEL": spec.model, "FLEET_VERSION": spec.version,
           "FLEET_REGION": settings.region, "FLEET_ROUTER_URLS": ",".join(settings.router_internal_urls),
           "FLEET_REPORT_KEY": key, **(extra_env or {})}
    info = {"kind": "replica", "replica_id": spec.replica_id, **common}
    started = time.monotonic()
    try:  # recorded at spawn, so `fleet down` stops a replica that is still loading
        proc = start_triton(settings, repository, base, settings.logs_dir / f"{name}.log", env,
                            on_spawn=lambda p: processes.record(settings, name, p, info))
    except Exception:
        processes.stop(settings, name)
        raise
    cold_start_s = time.monotonic() - started
    processes.record(settings, name, proc, {**info, "cold_start_s": round(cold_start_s, 2)})
    with session_scope(settings.db_url) as s:
        queries.upsert_replica(s, spec.replica_id, state="serving", pid=proc.pid, **common)
    log.info("replica %s serving on grpc %d after %.1f s", spec.replica_id, grpc, cold_start_s)
    return cold_start_s


def stop_replica(settings: Settings, replica_id: str) -> None:
    processes.stop(settings, f"replica-{replica_id}")
    with session_scope(settings.db_url) as s:
        queries.delete_replica(s, replica_id)
