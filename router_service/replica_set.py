"""Which replicas of a model version the router may use now, which are still starting, which it holds
back from new work, and which it cordoned after a failure (docs/reliability.md, Self-healing).

Usable means: `serving` in the router's registry snapshot and not cordoned by this router. A cordon lifts
when the registry records a restart (a new process id) or when a probe of the replica answers
(`uncordon`, router_service/replica_probe.py). Placeable means usable and not held back: a replica is held
while it is *overloaded* (a stream of it waits past its timeout while its reports show the engine
stepping: slow, not dead) and
while it is *suspect* (a stream timed out on the last serving replica of its model while it stopped
reporting: never cordoned on timeouts alone, probed instead). Requests for a version whose replicas are
held, or starting (a registry row in `starting`/`loading` younger than `start_wait_s`), wait in the
admission queue instead of failing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

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
    def __init__(self, registry: RegistryCache, states: ReplicaStateTable, start_wait_s: float = 600.0,
                 recover_wait_s: float = 120.0) -> None:
        self.registry = registry
        self.states = states
        self.start_wait_s = start_wait_s  # a row `starting` for longer than this is presumed dead
        self.recover_wait_s = recover_wait_s  # requests wait this long for a suspect replica to answer again
        self.cordoned: dict[str, float] = {}  # replica -> monotonic time the router cordoned it
        self.cordon_pids: dict[str, int] = {}  # replica -> its registry pid when cordoned
        self.suspect: dict[str, float] = {}   # replica -> monotonic time it became suspect (see module doc)
        self.slow: dict[str, int] = {}  # overloaded replica -> its streams waiting past a timeout (judged slow)
        self.on_trouble: Callable[[str], None] = lambda replica_id: None  # the prober's wake-up (replica_probe)
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

    def held(self, replica_id: str) -> bool:
        """Held back from new work: suspect, or overloaded (a stream of it waits past its timeout)."""
        return replica_id in self.suspect or self.slow.get(replica_id, 0) > 0

    def serving(self, model: ModelInfo, exclude: set[str]) -> list[ReplicaInfo]:
        """The replicas new work may go to now."""
        return [r for r in self._usable(model, exclude) if not self.held(r.replica_id)]

    def _usable(self, model: ModelInfo, exclude: set[str]) -> list[ReplicaInfo]:
        return [r for r in self.registry.snapshot.replicas if r.model == model.name and r.version == model.version
                and r.replica_id not in exclude and self.usable(r)]

    def is_last(self, model: ModelInfo, replica_id: str) -> bool:
        """No other replica of this version is usable and unsuspected (one that is only overloaded counts)."""
        return not any(r.replica_id not in self.suspect for r in self._usable(model, {replica_id}))

    def slow_begin(self, replica_id: str) -> None:
        """Back-pressure: one of the replica's streams waits past its timeout while its engine steps."""
        self.slow[replica_id] = self.slow.get(replica_id, 0) + 1

    def slow_end(self, replica_id: str) -> None:
        """That stream got its next response, or ended."""
        left = self.slow.get(replica_id, 0) - 1
        if left > 0:
            self.slow[replica_id] = left
        else:
            self.slow.pop(replica_id, None)

    def suspect_replica(self, replica_id: str, why: str) -> None:
        """The last serving replica of its model stopped answering: hold it from new work and probe it."""
        if replica_id not in self.suspect:
            self.suspect[replica_id] = time.monotonic()
            metrics.SUSPECTS.labels(replica_id).inc()
            log.warning("replica %s is suspect (not cordoned: it is the last serving replica of its model): %s",
                        replica_id, why)
        self.on_trouble(replica_id)

    def answered(self, replica_id: str) -> None:
        """The replica streamed a token or answered a probe: it is not suspect any more."""
        if self.suspect.pop(replica_id, None) is not None:
            log.info("replica %s answers again: no longer suspect", replica_id)

    def recovering(self, model: ModelInfo, exclude: set[str]) -> bool:
        """Some usable replica of this version is only held back (overloaded, or suspect for less than
        recover_wait_s): worth waiting for."""
        now = time.monotonic()
        return any(self.held(r.replica_id) and now - self.suspect.get(r.replica_id, now) < self.recover_wait_s
                   for r in self._usable(model, exclude))

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
        if self.starting(model, home, tier) or self.recovering(model, exclude):
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
        self.suspect.pop(replica_id, None)
        self._readiness.clear()
        metrics.CORDONS.labels(replica_id).inc()
        log.warning("cordoned replica %s: %s", replica_id, why)
        asyncio.get_running_loop().run_in_executor(None, self.record_state, replica_id, "cordoned")
        self.on_trouble(replica_id)

    def uncordon(self, replica_id: str, why: str) -> None:
        """Put a replica this router cordoned back in service (a probe answered); recorded in the registry."""
        if self.cordoned.pop(replica_id, None) is None:
            return
        self.cordon_pids.pop(replica_id, None)
        self._readiness.clear()
        metrics.UNCORDONS.labels(replica_id).inc()
        log.warning("uncordoned replica %s: %s", replica_id, why)
        asyncio.get_running_loop().run_in_executor(None, self.record_state, replica_id, "serving")

    def record_state(self, replica_id: str, state: str) -> None:
        from registry import queries
        from registry.db import session_scope
        try:
            with session_scope(self.registry.db_url) as s:
                queries.set_replica_state(s, replica_id, state, actor="router")
        except Exception as exc:
            log.warning("could not record %s of %s in the registry: %s", state, replica_id, exc)
