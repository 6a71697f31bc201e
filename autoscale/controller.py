"""The autoscaling loop: every few seconds, per model pool, read signals, decide, actuate.

Per pool: read the router's signals (queue wait p95, KV use, running/waiting, TTFT p95 vs the tier
SLO), ask the ForecastPolicy for the desired replicas (reactive need vs forecast need one measured
cold start ahead, + warm buffer from the registry, within min/max, slow scale-down) and hand the
answer to the actuator (local processes or Kubernetes). Every decision is logged and kept in
`history` (the live benchmark plots it).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autoscale.actuators import Actuator, PoolSpec
from autoscale.live_inputs import batch_demand
from autoscale.policy import ForecastPolicy, PoolState, ScalingGuard
from autoscale.signals import Signals, read_signals

log = logging.getLogger(__name__)


@dataclass
class PoolConfig:
    """A pool the controller scales, with its bounds and SLO (from the registry's warm_buffers)."""

    spec: PoolSpec
    min_replicas: int = 1
    max_replicas: int = 4
    min_idle_replicas: int = 0
    slo_ttft_s: float = 0.5
    max_running_per_replica: int = 8  # engine batch slots: running / slots is the load when tokens/s is missing
    capacity_tokens_per_s: float | None = None  # calibrated per-replica tokens/s (bench), None = unknown
    replica_seconds_per_request: float = 1.0  # converts a forecast (requests/s) into busy replicas
    default_cold_start_s: float = 30.0
    target_load: float = 0.7


@dataclass
class Decision:
    at: float
    pool: str
    serving: int
    starting: int
    desired: int
    signals: dict = field(default_factory=dict)


def pools_from_registry(db_url: str, region: str = "local") -> list[PoolConfig]:
    """One PoolConfig per managed model version: each warm_buffers row and each routed version (a routed
    version without a row inherits its model's settings, so a rollout's new version gets capacity)."""
    from registry.db import session_scope
    from registry.queries import get_model_version
    from registry.warm_buffers import managed_pools

    out = []
    with session_scope(db_url) as session:
        for wb in managed_pools(session):
            mv = get_model_version(session, wb.model, wb.version)
            tp = mv.tensor_parallel if mv is not None else 1
            out.append(PoolConfig(PoolSpec(wb.model, wb.version, region, tp), min_replicas=wb.min_replicas,
                                  max_replicas=wb.max_replicas, min_idle_replicas=wb.min_idle_replicas,
                                  slo_ttft_s=wb.slo_ttft_ms_p95 / 1000.0))
    return out


class Controller:
    """Runs the policy for every pool on a fixed interval."""

    def __init__(self, pools: list[PoolConfig], actuator: Actuator, router_url: str, interval_s: float = 2.0,
                 forecasts: dict[str, Callable[[float], float]] | None = None,
                 signal_reader: Callable[[PoolConfig], Signals] | None = None,
                 guard_overrides: dict | None = None, admin_token: str | None = None,
                 decisions_path: Path | None = None,
                 pools_source: Callable[[], list[PoolConfig]] | None = None) -> None:
        self.actuator, self.router_url = actuator, router_url
        self.decisions_path = decisions_path  # JSON lines the admin UI shows; only scaling decisions
        self.interval_s = interval_s
        self.forecasts = forecasts or {}
        self.admin_token = admin_token
        self.read = signal_reader or self._read_router
        self.history: list[Decision] = []
        self._stop = threading.Event()
        self.policies: dict[str, ForecastPolicy] = {}
        self.guard_overrides = guard_overrides or {}
        self.pools_source = pools_source
        self.pools: list[PoolConfig] = []
        for pool in pools:
            self._add_pool(pool)

    def _add_pool(self, pool: PoolConfig) -> None:
        guard = ScalingGuard(min_replicas=pool.min_replicas, max_replicas=pool.max_replicas, up_cooldown_s=self.interval_s,
                             down_cooldown_s=60.0, down_window_s=30.0, down_step_fraction=0.25,
                             down_step_interval_s=30.0)
        for key, value in self.guard_overrides.items():
            setattr(guard, key, value)
        forecast = self.forecasts.get(pool.spec.name, lambda _now: 0.0)
        self.policies[pool.spec.name] = ForecastPolicy(
            guard, forecast_need=forecast, cold_start_s=lambda p=pool: self._cold_start(p),
            warm_buffer=pool.min_idle_replicas, replica_seconds_per_request=pool.replica_seconds_per_request,
            target_load=pool.target_load, smoothing_halflife_s=self.interval_s / 2)
        self.pools.append(pool)
        adopt = getattr(self.actuator, "adopt", None)
        if adopt is not None:  # take over replicas of the pool already serving
            try:
                adopt(pool.spec)
            except Exception:  # the pool is still managed: its next tick retries through counts/scale
                log.exception("pool %s: adopting its replicas failed", pool.spec.name)

    def sync_pools(self) -> None:
        """Re-read which pools to manage (every tick when a `pools_source` is given): a newly routed version
        gets a pool at once; a pool no longer managed (unrouted, no warm-buffer row) is scaled to zero."""
        if self.pools_source is None:
            return
        try:
            wanted = {p.spec: p for p in self.pools_source()}
        except Exception as exc:  # registry unreachable: keep managing what we have
            log.warning("cannot read the managed pools (%s); keeping %d", exc, len(self.pools))
            return
        current = {p.spec: p for p in self.pools}
        for spec, pool in wanted.items():
            if spec not in current:
                log.info("pool %s is now managed (%d..%d replicas)", spec.name, pool.min_replicas, pool.max_replicas)
                self._add_pool(pool)
            elif (pool.min_replicas, pool.max_replicas) != (current[spec].min_replicas, current[spec].max_replicas):
                guard = self.policies[spec.name].guard
                guard.min_replicas, guard.max_replicas = pool.min_replicas, pool.max_replicas
                current[spec].min_replicas, current[spec].max_replicas = pool.min_replicas, pool.max_replicas
        for spec, pool in current.items():
            if spec not in wanted:
                log.info("pool %s is no longer managed (not routed, no warm buffer): scaling it to zero", spec.name)
                self.pools.remove(pool)
                del self.policies[spec.name]
                try:
                    if self.actuator.counts(spec).total:
                        self.actuator.scale(spec, 0)
                except Exception:
                    log.exception("pool %s: scaling it to zero failed", spec.name)

    def _cold_start(self, pool: PoolConfig) -> float:
        measured = self.actuator.cold_start_s(pool.spec)
        return measured if measured is not None else pool.default_cold_start_s

    def _read_router(self, pool: PoolConfig) -> Signals:
        return read_signals(self.router_url, pool.spec.model, pool.slo_ttft_s, pool.capacity_tokens_per_s,
                            admin_token=self.admin_token, version=pool.spec.version)

    def tick(self, now: float | None = None) -> list[Decision]:
        now = time.monotonic() if now is None else now
        self.sync_pools()
        out = []
        for pool in list(self.pools):
            try:  # one pool's error (API 422, registry down, a full disk) never stops the others or the loop
                decision = self._tick_pool(pool, now)
            except Exception:
                log.exception("pool %s: tick failed; the other pools go on and it is retried next tick",
                              pool.spec.name)
                continue
            if decision is not None:
                out.append(decision)
        return out

    def _tick_pool(self, pool: PoolConfig, now: float) -> Decision | None:
        try:
            sig = self.read(pool)
        except Exception as exc:  # no signals: hold the current size rather than guess
            log.warning("pool %s: cannot read signals (%s); holding", pool.spec.name, exc)
            return None
        heal = getattr(self.actuator, "heal", None)
        if heal is not None:  # restart replicas the routers cordoned and could not probe back
            heal(pool.spec)
        counts = self.actuator.counts(pool.spec)  # cordoned replicas are missing capacity, not serving
        slots = max(counts.serving, 1) * pool.max_running_per_replica
        sig.load = max(sig.load, min(1.0, (sig.running + sig.waiting) / slots))
        # batch demand: the batch requests queued in the router, due by their earliest deadline
        state = PoolState(now, counts.serving, counts.starting, sig,
                          batch_demand(sig, pool.replica_seconds_per_request))
        desired = self.policies[pool.spec.name].decide(state)
        decision = Decision(now, pool.spec.name, counts.serving, counts.starting, desired,
                            {"load": round(sig.load, 3), "kv": round(sig.kv_utilisation, 3), "running": sig.running,
                             "waiting": sig.waiting, "ttft_p95_s": round(sig.ttft_p95_s, 3),
                             "queue_wait_p95_s": round(sig.queue_wait_p95_s, 3), "batch_waiting": sig.batch_waiting,
                             "batch_required": round(state.batch_required, 3)})
        self.history.append(decision)
        if desired != counts.total:
            log.info("pool %s: %d serving + %d starting -> %d (load %.2f, kv %.2f, waiting %.0f, ttft p95 %.3f s, "
                     "queue wait p95 %.3f s)", pool.spec.name, counts.serving, counts.starting, desired, sig.load,
                     sig.kv_utilisation, sig.waiting, sig.ttft_p95_s, sig.queue_wait_p95_s)
            self._record(decision, "scale up" if desired > counts.total else "scale down (drain)")
            self.actuator.scale(pool.spec, desired)
        return decision

    def _record(self, decision: Decision, reason: str) -> None:
        if self.decisions_path is None:
            return
        try:  # the record is for people; an unwritable path must not stop the scaling it records
            self.decisions_path.parent.mkdir(parents=True, exist_ok=True)
            with self.decisions_path.open("a") as f:
                f.write(json.dumps({**asdict(decision), "ts": time.time(), "reason": reason}) + "\n")
        except OSError as exc:
            log.warning("cannot record the decision in %s: %s", self.decisions_path, exc)

    def run(self, duration_s: float | None = None) -> None:
        """Tick every interval until stop() (or duration_s elapses)."""
        end = None if duration_s is None else time.monotonic() + duration_s
        log.info("autoscaler running: %d pool(s), every %.1f s", len(self.pools), self.interval_s)
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            started = time.monotonic()
            self.tick(started)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
