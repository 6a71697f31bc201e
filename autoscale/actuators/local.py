"""Local actuator: starts and stops real `tritonserver` replicas on this machine (what `make up` uses).

Scale-up: `autoscale.actuators.replicas.start_replica` in a background thread (Triton on the model version's
rendered repository, registered `starting` then `serving`, recorded in the run dir so `make down`
stops it); the measured start->ready time feeds the cold-start estimate.
Scale-down: mark the replica `draining` in the registry (routers stop admitting to it), wait until
the router reports no in-flight streams on it (fallback: Triton's pending-request metric), then stop
the process and delete its registry row.
Healing (docs/reliability.md, Self-healing): a replica whose registry row is `cordoned` is missing capacity
(not counted as serving). One that a router cordoned and that stays cordoned for `restart_cordoned_after_s`
(the router's probes of it kept failing: a probe that answers uncordons it) is restarted at the same index
(`heal`); a new process id lifts the routers' cordon. A cordon by an operator is left alone.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.actuators.healing import CordonWatch, cordoned_replicas
from autoscale.signals import replica_inflight, router_admits
from autoscale.actuators.replicas import ReplicaSpec, replica_base_port, start_replica, stop_replica
from common import processes
from common.settings import REPO_ROOT, Settings
from python_backends.engine.config import engine_overrides
from registry.db import session_scope
from registry.queries import list_replicas, set_replica_state

log = logging.getLogger(__name__)


@dataclass
class LocalReplica:
    spec: ReplicaSpec
    pool: PoolSpec
    state: str = "starting"  # starting | serving | draining | stopped | failed
    started_at: float = field(default_factory=time.monotonic)
    cold_start_s: float = 0.0
    drain_s: float = 0.0
    inflight_at_drain: int | None = None

    @property
    def replica_id(self) -> str:
        return self.spec.replica_id


class LocalActuator:
    """Runs replicas as local processes; thread-safe; every transition is logged and written to the registry."""

    def __init__(self, settings: Settings, router_urls: list[str] | None = None, drain_timeout_s: float = 120.0,
                 admin_token: str | None = None, first_index: int = 0, cpu_cores: int | None = None,
                 cpu_budget: bool = True, restart_cordoned_after_s: float = 30.0) -> None:
        self.settings = settings
        self.cordons = CordonWatch(restart_cordoned_after_s)
        # CPU budget: replicas x engine threads <= cores, so a new replica adds capacity instead of
        # sharing the same cores with the ones already running. cpu_budget=False lifts it (told so).
        self.cpu_cores = cpu_cores or len(os.sched_getaffinity(0))
        self.max_replicas = max(1, self.cpu_cores // engine_threads()) if cpu_budget else None
        self.router_urls = router_urls or [settings.router_http_url]
        self.drain_timeout_s = drain_timeout_s
        self.admin_token = admin_token
        self.first_index = first_index
        self.replicas: dict[str, LocalReplica] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.cold_starts_path = settings.data_dir / "autoscale" / "cold_starts.json"
        self.forced_stops = 0  # drains that timed out with streams still open
        self.events: list[dict] = []  # (time, replica, what) for the live benchmark

    def _event(self, replica: LocalReplica, what: str, **extra) -> None:
        self.events.append({"t": time.time(), "replica_id": replica.replica_id, "event": what, **extra})

    # --- bookkeeping -----------------------------------------------------------------------------
    def adopt(self, pool: PoolSpec) -> None:
        """Take over replicas of this pool already serving (e.g. the one `make up` started)."""
        with session_scope(self.settings.db_url) as session:
            rows = [r for r in list_replicas(session, pool.model) if r.version == pool.version and r.state == "serving"]
        for row in rows:
            if row.replica_id in self.replicas:
                continue
            index = int(row.replica_id.rsplit("-r", 1)[-1]) if row.replica_id.rsplit("-r", 1)[-1].isdigit() else -1
            spec = ReplicaSpec(pool.model, pool.version, index)
            if spec.replica_id == row.replica_id:
                self.replicas[row.replica_id] = LocalReplica(spec, pool, state="serving", started_at=0.0)
                log.info("adopted serving replica %s", row.replica_id)

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        cordoned = self._cordoned_rows(pool)
        with self._lock:
            mine = [r for r in self.replicas.values() if r.pool == pool]
        return ReplicaCounts(serving=sum(r.state == "serving" and r.replica_id not in cordoned for r in mine),
                             starting=sum(r.state == "starting" for r in mine),
                             draining=sum(r.state == "draining" for r in mine),
                             cordoned=sum(r.state == "serving" and r.replica_id in cordoned for r in mine))

    def _cordoned_rows(self, pool: PoolSpec) -> set[str]:
        return cordoned_replicas(self.settings.db_url, pool.model, pool.version)

    # --- healing ---------------------------------------------------------------------------------
    def heal(self, pool: PoolSpec) -> list[str]:
        """Restart this pool's replicas that a router cordoned and that this actuator has seen cordoned for
        restart_cordoned_after_s (the router's probes kept failing); returns their ids."""
        with self._lock:
            mine = {r.replica_id: r for r in self.replicas.values() if r.pool == pool and r.state == "serving"}
        stuck = self.cordons.due(self.settings.db_url, mine, self._cordoned_rows(pool))
        for replica_id in stuck:
            self.restart_replica(mine[replica_id])
        return stuck

    def restart_replica(self, replica: LocalReplica) -> None:
        """Stop the process and start it again at the same index (in the background, like a start)."""
        log.warning("replica %s stayed cordoned by a router (its probes keep failing): restarting it",
                    replica.replica_id)
        replica.state, replica.started_at = "starting", time.monotonic()
        self._event(replica, "restart")

        def again() -> None:
            for info in processes.running(self.settings):  # cordoned and failing probes: nothing to drain, and a
                if info["name"] == f"replica-{replica.replica_id}" and info["alive"]:  # frozen one ignores SIGTERM
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(info["pid"], signal.SIGKILL)
            stop_replica(self.settings, replica.replica_id)
            self._start(replica)
        thread = threading.Thread(target=again, name=f"restart-{replica.replica_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        starts = self._cold_starts().get(pool.model, [])
        return float(np.percentile(starts[-50:], 90)) if starts else None

    def _cold_starts(self) -> dict[str, list[float]]:
        try:
            return json.loads(self.cold_starts_path.read_text())
        except (OSError, ValueError):
            return {}

    def _record_cold_start(self, model: str, seconds: float) -> None:
        with self._lock:
            data = self._cold_starts()
            data.setdefault(model, []).append(round(seconds, 3))
            self.cold_starts_path.parent.mkdir(parents=True, exist_ok=True)
            self.cold_starts_path.write_text(json.dumps(data))

    def _next_index(self, pool: PoolSpec) -> int:
        used = {r.spec.index for r in self.replicas.values() if r.pool.model == pool.model and r.state != "stopped"}
        index = self.first_index
        while index in used:
            index += 1
        return index

    # --- scaling ---------------------------------------------------------------------------------
    def scale(self, pool: PoolSpec, desired: int) -> None:
        current = self.counts(pool)
        if desired > current.total and self.max_replicas is not None:
            with self._lock:
                alive = sum(r.state in ("starting", "serving", "draining") for r in self.replicas.values())
            room = max(self.max_replicas - alive, 0)
            # a pool the controller manages is routed: it gets one replica (a cordoned one is restarted instead, heal)
            if current.total == 0 and current.cordoned == 0 and room == 0:
                log.warning("pool %s has no replica: starting one over the CPU budget (%d replicas on %d cores) so "
                            "its routed traffic has somewhere to go", pool.name, self.max_replicas, self.cpu_cores)
                room = 1
            if desired - current.total > room:
                log.warning("pool %s wants %d replicas; CPU budget allows %d more (%d cores / %d engine threads = "
                            "%d replicas, %d running)", pool.name, desired, room, self.cpu_cores, engine_threads(),
                            self.max_replicas, alive)
                desired = current.total + room
        if desired > current.total:
            for _ in range(desired - current.total):
                self.start_replica(pool)
        elif desired < current.total:
            with self._lock:  # cancel starting ones first, then the newest serving ones
                candidates = sorted((r for r in self.replicas.values() if r.pool == pool and r.state in ("serving", "starting")),
                                    key=lambda r: (r.state != "starting", -r.started_at))
            for replica in candidates[:current.total - desired]:
                self.drain_replica(replica.replica_id)

    def start_replica(self, pool: PoolSpec) -> LocalReplica:
        with self._lock:
            spec = ReplicaSpec(pool.model, pool.version, self._next_index(pool))
            replica = LocalReplica(spec, pool)
            self.replicas[replica.replica_id] = replica
        log.info("starting replica %s (%s/%s) on ports from %d", replica.replica_id, pool.model, pool.version,
                 replica_base_port(self.settings, spec.index))
        self._event(replica, "start")
        thread = threading.Thread(target=self._start, args=(replica,), name=f"start-{replica.replica_id}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return replica

    def _start(self, replica: LocalReplica) -> None:
        try:
            replica.cold_start_s = start_replica(self.settings, replica.spec)
        except Exception as exc:  # the replica never became ready: forget it
            log.error("replica %s failed to start: %s", replica.replica_id, str(exc).splitlines()[0] if str(exc) else exc)
            replica.state = "failed"
            self._event(replica, "failed")
            stop_replica(self.settings, replica.replica_id)
            return
        if replica.state == "draining":  # scaled down while starting: nothing was admitted, stop at once
            stop_replica(self.settings, replica.replica_id)
            replica.state = "stopped"
            self._event(replica, "stopped")
            return
        replica.state = "serving"
        self._record_cold_start(replica.pool.model, replica.cold_start_s)
        self._event(replica, "serving", cold_start_s=replica.cold_start_s)
        log.info("replica %s serving after a %.1f s cold start", replica.replica_id, replica.cold_start_s)

    def drain_replica(self, replica_id: str) -> None:
        replica = self.replicas[replica_id]
        was_starting = replica.state == "starting"
        replica.state = "draining"
        self._event(replica, "draining")
        if was_starting:
            log.info("replica %s cancelled while starting; it stops as soon as it is up", replica_id)
            return
        with session_scope(self.settings.db_url) as session:
            set_replica_state(session, replica_id, "draining", actor="autoscaler")
        log.info("draining replica %s: routers stop admitting; waiting for its in-flight streams", replica_id)
        thread = threading.Thread(target=self._drain, args=(replica,), name=f"drain-{replica_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _inflight(self, replica: LocalReplica) -> int | None:
        for url in self.router_urls:
            value = replica_inflight(url, replica.replica_id, self.admin_token)
            if value is not None:
                return value
        return triton_pending(replica_base_port(self.settings, replica.spec.index) + 2)

    def _drain(self, replica: LocalReplica) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.drain_timeout_s
        replica.inflight_at_drain = self._inflight(replica)
        # until every router has reloaded the registry and stopped admitting there (not a fixed sleep: a
        # loaded router may take longer, and a stream admitted after the in-flight check would be cut)
        while time.monotonic() < deadline and any(router_admits(url, replica.replica_id, self.admin_token)
                                                  for url in self.router_urls):
            time.sleep(0.25)
        while time.monotonic() < deadline:
            if self._inflight(replica) == 0:
                break
            time.sleep(0.25)
        else:
            self.forced_stops += 1
            log.warning("replica %s still had streams after %.0f s; stopping anyway", replica.replica_id, self.drain_timeout_s)
        stop_replica(self.settings, replica.replica_id)
        replica.state, replica.drain_s = "stopped", time.monotonic() - t0
        self._event(replica, "stopped", drain_s=replica.drain_s, inflight_at_drain=replica.inflight_at_drain)
        log.info("replica %s drained in %.1f s and stopped", replica.replica_id, replica.drain_s)

    def stop_all(self) -> None:
        """Stop every replica this actuator started (not adopted ones)."""
        for replica in list(self.replicas.values()):
            if replica.state in ("serving", "draining", "starting") and replica.started_at > 0:
                stop_replica(self.settings, replica.replica_id)
                replica.state = "stopped"

    def wait_idle(self, timeout_s: float = 300.0) -> None:
        """Wait for background starts/drains (tests and the benchmark use this)."""
        for thread in list(self._threads):
            thread.join(timeout=timeout_s)


_PENDING = re.compile(r'^nv_inference_pending_request_count\{[^}]*\}\s+([0-9.eE+-]+)', re.M)


def engine_threads() -> int:
    """Torch threads each local engine replica runs: FLEET_ENGINE_THREADS, else the engine model's
    config.pbtxt `threads` parameter (what python_backends/engine reads), else 2."""
    threads = engine_overrides().get("threads")
    if threads:
        return max(1, threads)
    try:
        text = (REPO_ROOT / "model_repository" / "engine" / "config.pbtxt").read_text()
    except OSError:
        return 2
    match = re.search(r'key:\s*"threads"\s*value:\s*{\s*string_value:\s*"(\d+)"', text)
    return max(1, int(match.group(1))) if match else 2


def triton_pending(metrics_port: int) -> int | None:
    """Requests Triton still holds (queued or executing), from its Prometheus metrics; None if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return int(sum(float(v) for v in _PENDING.findall(text)))
