"""Local actuator: starts and stops real `tritonserver` replicas on this machine (what `make up` uses).

Scale-up: pick a free port block, start Triton on the model version's rendered repository in a
background thread (start_triton waits until ready), record the replica in the registry as
`starting`, then `serving` once ready; the measured start->ready time feeds the cold-start estimate.
Scale-down: mark the newest replica `draining` in the registry (routers stop admitting to it), wait
until the router reports no in-flight streams on it (falling back to Triton's pending-request metric),
then stop the process and delete its row.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.signals import replica_inflight
from fleet.processes import port_open, stop_pid
from fleet.settings import Settings
from registry.db import session_scope
from registry.queries import delete_replica, get_model_version, list_replicas, upsert_replica

log = logging.getLogger(__name__)


@dataclass
class LocalReplica:
    replica_id: str
    pool: PoolSpec
    base_port: int
    state: str = "starting"
    pid: int = 0
    started_at: float = field(default_factory=time.monotonic)
    error: str = ""


class LocalActuator:
    """Runs replicas as local processes; thread-safe; every transition is logged and written to the registry."""

    def __init__(self, settings: Settings, router_urls: list[str] | None = None, drain_timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0, admin_token: str | None = None) -> None:
        self.settings = settings
        self.router_urls = router_urls or [settings.router_http_url]
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.admin_token = admin_token
        self.replicas: dict[str, LocalReplica] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.cold_starts_path = settings.data_dir / "autoscale" / "cold_starts.json"
        self.failed_drains = 0

    # --- bookkeeping -----------------------------------------------------------------------------
    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        with self._lock:
            mine = [r for r in self.replicas.values() if r.pool == pool]
        return ReplicaCounts(serving=sum(r.state == "serving" for r in mine),
                             starting=sum(r.state == "starting" for r in mine),
                             draining=sum(r.state == "draining" for r in mine))

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        starts = self._cold_starts().get(pool.model, [])
        return float(np.percentile(starts[-50:], 90)) if starts else None

    def _cold_starts(self) -> dict[str, list[float]]:
        return json.loads(self.cold_starts_path.read_text()) if self.cold_starts_path.exists() else {}

    def _record_cold_start(self, model: str, seconds: float) -> None:
        with self._lock:
            data = self._cold_starts()
            data.setdefault(model, []).append(round(seconds, 3))
            self.cold_starts_path.parent.mkdir(parents=True, exist_ok=True)
            self.cold_starts_path.write_text(json.dumps(data))

    def _free_base_port(self) -> int:
        used = {r.base_port for r in self.replicas.values()}
        port = self.settings.replica_base_port
        while port in used or any(port_open("127.0.0.1", port + i) for i in range(3)):
            port += 3
        return port

    def repository(self, pool: PoolSpec) -> Path:
        with session_scope(self.settings.db_url) as session:
            row = get_model_version(session, pool.model, pool.version)
            if row is not None and row.repository_path:
                return Path(row.repository_path)
        return self.settings.engines_dir / pool.model / pool.version / "model_repository"

    # --- scaling ---------------------------------------------------------------------------------
    def scale(self, pool: PoolSpec, desired: int) -> None:
        current = self.counts(pool)
        if desired > current.total:
            for _ in range(desired - current.total):
                self.start_replica(pool)
        elif desired < current.total:
            with self._lock:
                candidates = sorted((r for r in self.replicas.values() if r.pool == pool and r.state in ("serving", "starting")),
                                    key=lambda r: (r.state != "starting", -r.started_at))
            for replica in candidates[:current.total - desired]:
                self.drain_replica(replica.replica_id)

    def start_replica(self, pool: PoolSpec) -> LocalReplica:
        with self._lock:
            replica = LocalReplica(f"{pool.name}-{uuid.uuid4().hex[:6]}", pool, self._free_base_port())
            self.replicas[replica.replica_id] = replica
        log.info("starting replica %s (%s/%s) on ports %d-%d", replica.replica_id, pool.model, pool.version,
                 replica.base_port, replica.base_port + 2)
        thread = threading.Thread(target=self._start, args=(replica,), name=f"start-{replica.replica_id}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return replica

    def _start(self, replica: LocalReplica) -> None:
        from fleet.services import start_triton

        pool, base = replica.pool, replica.base_port
        urls = dict(grpc_url=f"127.0.0.1:{base + 1}", http_url=f"http://127.0.0.1:{base}",
                    metrics_url=f"http://127.0.0.1:{base + 2}/metrics")
        with session_scope(self.settings.db_url) as session:
            upsert_replica(session, replica.replica_id, model=pool.model, version=pool.version, region=pool.region,
                           state="starting", pid=0, **urls)
        env = {"FLEET_REPLICA_ID": replica.replica_id, "FLEET_MODEL": pool.model, "FLEET_VERSION": pool.version,
               "FLEET_REGION": pool.region, "FLEET_ROUTER_URLS": ",".join(self.router_urls)}
        log_path = self.settings.logs_dir / f"replica-{replica.replica_id}.log"
        t0 = time.monotonic()
        try:
            proc = start_triton(self.settings, self.repository(pool), base, log_path, extra_env=env,
                                timeout_s=self.start_timeout_s)
        except Exception as exc:  # the replica never became ready: forget it
            log.error("replica %s failed to start: %s", replica.replica_id, str(exc).splitlines()[0])
            replica.state, replica.error = "failed", str(exc)
            with session_scope(self.settings.db_url) as session:
                delete_replica(session, replica.replica_id)
            return
        cold = time.monotonic() - t0
        replica.pid = proc.pid
        if replica.state == "draining":  # scaled down while starting: stop at once
            stop_pid(proc.pid)
            with session_scope(self.settings.db_url) as session:
                delete_replica(session, replica.replica_id)
            replica.state = "stopped"
            return
        with session_scope(self.settings.db_url) as session:
            upsert_replica(session, replica.replica_id, state="serving", pid=proc.pid)
        replica.state = "serving"
        self._record_cold_start(pool.model, cold)
        log.info("replica %s serving after a %.1f s cold start (pid %d)", replica.replica_id, cold, proc.pid)

    def drain_replica(self, replica_id: str) -> None:
        replica = self.replicas[replica_id]
        was_starting = replica.state == "starting"
        replica.state = "draining"
        with session_scope(self.settings.db_url) as session:
            upsert_replica(session, replica_id, state="draining")
        if was_starting:
            log.info("replica %s cancelled while starting; it stops when ready", replica_id)
            return
        log.info("draining replica %s: routers stop admitting; waiting for in-flight streams", replica_id)
        thread = threading.Thread(target=self._drain, args=(replica,), name=f"drain-{replica_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _inflight(self, replica: LocalReplica) -> int | None:
        for url in self.router_urls:
            value = replica_inflight(url, replica.replica_id, self.admin_token)
            if value is not None:
                return value
        return triton_pending(replica.base_port + 2)

    def _drain(self, replica: LocalReplica) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        time.sleep(1.0)  # let routers see the registry change (they poll about every second)
        while time.monotonic() < deadline:
            inflight = self._inflight(replica)
            if inflight == 0:
                break
            time.sleep(0.5)
        else:
            self.failed_drains += 1
            log.warning("replica %s still had streams after %.0f s; stopping anyway", replica.replica_id, self.drain_timeout_s)
        stop_pid(replica.pid)
        with session_scope(self.settings.db_url) as session:
            delete_replica(session, replica.replica_id)
        replica.state = "stopped"
        log.info("replica %s drained and stopped", replica.replica_id)

    def adopt_registry(self, pool: PoolSpec) -> None:
        """Forget registry rows of this pool whose process is gone (after a controller restart)."""
        from fleet.processes import pid_alive

        with session_scope(self.settings.db_url) as session:
            for row in list_replicas(session, pool.model):
                if row.version == pool.version and row.replica_id not in self.replicas and not (row.pid and pid_alive(row.pid)):
                    delete_replica(session, row.replica_id)

    def stop_all(self) -> None:
        for replica in list(self.replicas.values()):
            if replica.pid and replica.state in ("serving", "draining", "starting"):
                stop_pid(replica.pid)
                with session_scope(self.settings.db_url) as session:
                    delete_replica(session, replica.replica_id)
                replica.state = "stopped"

    def wait_idle(self, timeout_s: float = 300.0) -> None:
        """Wait for background starts/drains (tests and the benchmark use this)."""
        for thread in list(self._threads):
            thread.join(timeout=timeout_s)


_PENDING = re.compile(r'^nv_inference_pending_request_count\{[^}]*\}\s+([0-9.eE+-]+)', re.M)


def triton_pending(metrics_port: int) -> int | None:
    """Requests Triton still holds (queued or executing), from its Prometheus metrics; None if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return int(sum(float(v) for v in _PENDING.findall(text)))
