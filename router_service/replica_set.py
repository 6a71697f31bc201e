"""Which replicas of a model version the router may use now, which are still starting, and which it
cordoned after a failure.

Serving means: `serving` in the router's registry snapshot and not cordoned by this router (a cordon lifts
only when the registry records a restart: a new process id). Starting means: a registry row in
`starting`/`loading` (written by whoever spawned the replica, before its model loads) that is younger than
`start_wait_s`; requests for such a version wait in the admission queue instead of failing.
"""
from __future__ import annotations

import asyncio
import logging
import time

from router_service import metrics
from router_service.errors import RouterError
from router_service.regions import candidate_tiers
from router_service.registry_cache import ModelInfo, RegistryCache, ReplicaInfo, Snapshot
from router_service.replica_state import ReplicaStateTable
from router_service.rollout import VersionReadiness, rollout_readiness

log = logging.getLogger(__name__)
STARTING_STATES = ("starting", "loading")
READINESS_TTL_S = 0.2


class ReplicaSet:
    def __init__(self, registry: RegistryCache, states: ReplicaStateTable, start_wait_s: float = 600.0) -> None:
        self.registry = registry
        self.states = states
        self.start_wait_s = start_wait_s  # a row `starting` for longer than this is presumed dead
        self.cordoned: dict[str, float] = {}  # replica -> monotonic time the router cordoned it
        self.cordon_pids: dict[str, int] = {}  # replica -> its registry pid when cordoned
        self._readiness: dict[tuple[str, str], tuple[Snapshot, float, list[VersionReadiness]]] = {}

    def usable(self, r: ReplicaInfo) -> bool:
        if r.state != "serving":
            return False
        if r.replica_id in self.cordoned:
            # only a restart recorded in the registry (a new process id) lifts the router's cordon; a state
            # report never does, whatever it says
            if self.cordon_pids.get(r.replica_id) == r.pid:
                return False
            log.info("replica %s was restarted (pid %d): uncordoned", r.replica_id, r.pid)
            del self.cordoned[r.replica_id]
            self.cordon_pids.pop(r.replica_id, None)
        return True

    def serving(self, model: ModelInfo, exclude: set[str]) -> list[ReplicaInfo]:
        return [r for r in self.registry.snapshot.replicas if r.model == model.name and r.version == model.version
                and r.replica_id not in exclude and self.usable(r)]

    def starting(self, model: ModelInfo, home: str, tier: str) -> list[ReplicaInfo]:
        """Starting replicas of this version in the regions a request of `tier` from `home` may use."""
        oldest = time.time() - self.start_wait_s
        rows = [r for r in self.registry.snapshot.replicas if r.model == model.name and r.version == model.version
                and r.state in STARTING_STATES and r.started_at >= oldest]
        return [r for group in candidate_tiers(rows, home, tier) for r in group]

    def must_wait(self, model: ModelInfo, home: str, tier: str, exclude: set[str]) -> bool:
        """False when a replica serves; True while none serves but one starts; 503 when none serves or starts."""
        if any(candidate_tiers(self.serving(model, exclude), home, tier)):
            return False
        if self.starting(model, home, tier):
            return True
        raise RouterError("unavailable", f"nothing serves or starts {model.name} version {model.version} in region "
                                         f"{home!r}: no replica is serving and none is starting", retry_after_ms=1000)

    def readiness(self, model: str, region: str) -> list[VersionReadiness]:
        """Per version: ready replicas and effective share; recomputed on every registry reload and at
        least every READINESS_TTL_S (cordons made by this router), not on every request."""
        snap, now = self.registry.snapshot, time.monotonic()
        cached = self._readiness.get((model, region))
        if cached is not None and cached[0] is snap and now - cached[1] < READINESS_TTL_S:
            return cached[2]
        result = rollout_readiness(snap, model, region, self.usable)
        self._readiness[(model, region)] = (snap, now, result)
        return result

    def cordon(self, replica_id: str, why: str) -> None:
        """Stop routing to a replica that failed; recorded in the registry (and its audit log) for the fleet."""
        if replica_id in self.cordoned:
            return
        self.cordoned[replica_id] = time.monotonic()
        self.cordon_pids[replica_id] = next((r.pid for r in self.registry.snapshot.replicas
                                             if r.replica_id == replica_id), 0)
        self._readiness.clear()
        metrics.CORDONS.labels(replica_id).inc()
        log.warning("cordoned replica %s: %s", replica_id, why)
        asyncio.get_running_loop().run_in_executor(None, self._record_cordon, replica_id)

    def _record_cordon(self, replica_id: str) -> None:
        from registry import queries
        from registry.db import session_scope
        try:
            with session_scope(self.registry.db_url) as s:
                queries.set_replica_state(s, replica_id, "cordoned", actor="router")
        except Exception as exc:
            log.warning("could not record cordon of %s in the registry: %s", replica_id, exc)
