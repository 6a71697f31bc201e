"""Scaling policies: desired replicas for one model pool from its signals (+ forecast, warm buffer).

All policies return the desired TOTAL replicas (starting + serving). `ScalingGuard` applies what every
policy shares: min/max bounds, a scale-up cooldown, and a slow scale-down (stabilisation window,
cooldown after any scale-up, bounded step) so drains are rare and gentle.

- StaticPolicy: provisioned for the peak, never moves.
- GpuUtilPolicy: HPA on GPU utilisation % (what nvidia-smi/DCGM report): the wrong signal.
- SignalsPolicy: reactive on queue wait / KV utilisation / engine load / TTFT vs SLO.
- ForecastPolicy ("ours"): max(reactive need, forecast need one cold start ahead) + warm buffer
  + the capacity batch work needs to meet its deadline (batch fills spare capacity, preemptible).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from autoscale.signals import Signals


@dataclass
class PoolState:
    """What a policy sees each tick for one pool."""

    now_s: float
    serving: int
    starting: int
    signals: Signals
    batch_required: float = 0.0  # replica-s/s batch work needs to meet its deadlines

    @property
    def total(self) -> int:
        return self.serving + self.starting


@dataclass
class ScalingGuard:
    """Bounds, cooldowns and slow scale-down shared by every policy."""

    min_replicas: int = 1
    max_replicas: int = 10_000
    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 600.0  # no scale-down this long after a scale-up
    down_window_s: float = 300.0  # scale down only to the max desired over this window
    down_step_fraction: float = 0.05  # at most this fraction of the pool per down step...
    down_step_interval_s: float = 60.0  # ...per this interval
    _history: deque = field(default_factory=deque, repr=False)  # (time, raw desired), values decreasing
    _last_up: float = -1e18
    _last_down: float = -1e18

    def apply(self, now_s: float, current: int, raw_desired: int) -> int:
        raw = max(self.min_replicas, min(self.max_replicas, raw_desired))
        # Window maximum of the raw desires: a monotonic deque (values decreasing from the left), so the
        # stable level is its first entry instead of a scan over the window every tick.
        while self._history and self._history[-1][1] <= raw:
            self._history.pop()
        self._history.append((now_s, raw))
        while self._history[0][0] < now_s - self.down_window_s:
            self._history.popleft()
        if raw > current:
            if now_s - self._last_up < self.up_cooldown_s:
                return current
            self._last_up = now_s
            return raw
        if raw < current:
            stable = self._history[0][1]
            if stable >= current or now_s - self._last_up < self.down_cooldown_s:
                return current
            if now_s - self._last_down < self.down_step_interval_s:
                return current
            step = max(1, math.floor(current * self.down_step_fraction))
            self._last_down = now_s
            return max(stable, current - step)
        return current


class Policy:
    name = "base"

    def __init__(self, guard: ScalingGuard) -> None:
        self.guard = guard

    def raw_desired(self, state: PoolState) -> int:
        raise NotImplementedError

    def decide(self, state: PoolState) -> int:
        return self.guard.apply(state.now_s, state.total, self.raw_desired(state))


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, replicas: int) -> None:
        super().__init__(ScalingGuard(min_replicas=replicas, max_replicas=replicas))
        self.replicas = replicas

    def raw_desired(self, state: PoolState) -> int:
        return self.replicas


class GpuUtilPolicy(Policy):
    """Kubernetes-HPA style: desired = ceil(current * gpu_util / target)."""

    name = "reactive-gpu-util"

    def __init__(self, guard: ScalingGuard, target: float = 0.7) -> None:
        super().__init__(guard)
        self.target = target

    def raw_desired(self, state: PoolState) -> int:
        return math.ceil(max(state.serving, 1) * state.signals.gpu_util / self.target)


class SignalsPolicy(Policy):
    """Reactive on the right signals: engine load, KV use, TTFT p95 vs SLO, admission queue wait."""

    name = "reactive-signals"

    def __init__(self, guard: ScalingGuard, target_load: float = 0.85, target_kv: float = 0.8,
                 ttft_fraction: float = 0.8, queue_wait_s: float = 0.2, breach_step: float = 0.1,
                 smoothing_halflife_s: float = 30.0) -> None:
        super().__init__(guard)
        self.target_load, self.target_kv = target_load, target_kv
        self.ttft_fraction, self.queue_wait_s, self.breach_step = ttft_fraction, queue_wait_s, breach_step
        self.halflife_s = smoothing_halflife_s
        self._work: float | None = None  # EWMA of busy replicas (load x serving)
        self._kv_work: float | None = None
        self._last_s: float | None = None

    def _smooth(self, state: PoolState) -> tuple[float, float]:
        """EWMA of the busy-replica equivalents so one noisy report does not start replicas."""
        sig = state.signals
        work, kv_work = sig.load * state.serving, sig.kv_utilisation * state.serving
        if self._work is None or self._last_s is None:
            self._work, self._kv_work = work, kv_work
        else:
            alpha = 1.0 - 0.5 ** (max(state.now_s - self._last_s, 0.0) / self.halflife_s)
            self._work += alpha * (work - self._work)
            self._kv_work += alpha * (kv_work - self._kv_work)
        self._last_s = state.now_s
        return self._work, self._kv_work

    def reactive_need(self, state: PoolState) -> int:
        sig = state.signals
        work, kv_work = self._smooth(state)
        need = math.ceil(max(work / self.target_load, kv_work / self.target_kv) - 1e-9)
        breach = (sig.ttft_ratio > self.ttft_fraction or sig.queue_wait_p95_s > self.queue_wait_s
                  or (sig.waiting > 0 and sig.load >= 0.99))
        if breach and state.starting == 0:  # replicas already starting will relieve it; do not pile on
            need = max(need, state.total + max(1, math.ceil(self.breach_step * state.total)))
        return need

    def raw_desired(self, state: PoolState) -> int:
        return self.reactive_need(state)


class ForecastPolicy(SignalsPolicy):
    """Ours: max(reactive need, forecast need one cold start ahead) + warm buffer + batch deadline need."""

    name = "ours"

    def __init__(self, guard: ScalingGuard, forecast_need: Callable[[float], float], cold_start_s: Callable[[], float],
                 warm_buffer: int, replica_seconds_per_request: float, target_load: float = 0.85,
                 burst_buffer_fraction: float = 0.0, **kwargs) -> None:
        super().__init__(guard, target_load=target_load, **kwargs)
        self.burst_buffer_fraction = burst_buffer_fraction
        self.forecast_rps = forecast_need
        self.cold_start_s = cold_start_s
        self.warm_buffer = warm_buffer
        self.w = replica_seconds_per_request

    def _offered_work(self, state: PoolState) -> float:
        """EWMA of the arrivals' work (requests/s x cost): unlike engine load it is not capped at 100 %,
        so an overload shows its full size at once."""
        work = state.signals.requests_per_s * self.w
        prev, last = getattr(self, "_offered", None), getattr(self, "_offered_at", None)
        if prev is None or last is None:
            self._offered = work
        else:
            alpha = 1.0 - 0.5 ** (max(state.now_s - last, 0.0) / self.halflife_s)
            self._offered = prev + alpha * (work - prev)
        self._offered_at = state.now_s
        return self._offered

    def raw_desired(self, state: PoolState) -> int:
        reactive = max(self.reactive_need(state), math.ceil(self._offered_work(state) / self.target_load - 1e-9))
        lead = self.cold_start_s()
        ahead = max(self.forecast_rps(state.now_s + lead), self.forecast_rps(state.now_s + 0.5 * lead))
        forecast = math.ceil(ahead * self.w / self.target_load - 1e-9)
        batch = state.batch_required / self.target_load
        fg_work = state.signals.load * state.serving
        with_batch = math.ceil((max(fg_work, ahead * self.w) + state.batch_required) / self.target_load - 1e-9) if batch else 0
        need = max(reactive, forecast, with_batch)
        # Warm buffer: the registry's min idle replicas, or a share of the need that covers a burst
        # arriving during one cold start (longer cold start, bigger share), whichever is larger.
        # Batch work keeps these replicas busy until interactive traffic preempts it.
        share = self.burst_buffer_fraction * lead / 180.0
        return need + max(self.warm_buffer, math.ceil(share * need))
