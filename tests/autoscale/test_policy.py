"""Policies and the shared guard: bounds, cooldowns, slow scale-down, the wrong and the right signals."""
from __future__ import annotations

from autoscale.policy import ForecastPolicy, GpuUtilPolicy, PoolState, ScalingGuard, SignalsPolicy, StaticPolicy
from autoscale.signals import Signals


def state(now: float, serving: int, starting: int = 0, **sig) -> PoolState:
    return PoolState(now, serving, starting, Signals(model="m", serving=serving, **sig))


def test_guard_bounds_and_slow_scale_down() -> None:
    guard = ScalingGuard(min_replicas=2, max_replicas=10, down_cooldown_s=60, down_window_s=30,
                         down_step_fraction=0.1, down_step_interval_s=20)
    assert guard.apply(0, 4, 50) == 10  # max bound
    assert guard.apply(10, 10, 1) == 10  # cooldown after scale-up
    assert guard.apply(50, 10, 1) == 10  # still in the scale-down cooldown
    assert guard.apply(100, 10, 1) == 9  # one step of max(1, 10 %)
    assert guard.apply(105, 9, 1) == 9  # step interval
    assert guard.apply(125, 9, 1) == 8
    current = 8
    for t in range(145, 600, 20):
        current = guard.apply(t, current, 1)
    assert current == 2  # one step at a time, never below min
    assert guard.apply(1000, 2, 0) == 2


def test_static_never_moves() -> None:
    assert StaticPolicy(7).decide(state(0, 3, load=1.0)) == 7


def test_gpu_util_saturates_and_scales_up_whatever_the_batch() -> None:
    policy = GpuUtilPolicy(ScalingGuard(max_replicas=100), target=0.7)
    # 1 running stream per replica already reads ~100 % "utilisation": the policy asks for more
    assert policy.decide(state(0, 10, gpu_util=0.99, load=0.1)) == 15


def test_signals_policy_scales_on_load_and_on_ttft_breach_once() -> None:
    policy = SignalsPolicy(ScalingGuard(max_replicas=100), target_load=0.8)
    assert policy.decide(state(0, 10, load=0.96)) == 12
    breach = policy.decide(state(10, 12, load=0.5, ttft_p95_s=0.6, slo_ttft_s=0.5))
    assert breach >= 14  # TTFT over the SLO: add 10 % at least
    # replicas already starting: no pile-on while they warm up
    assert policy.decide(state(20, 12, starting=2, load=0.5, ttft_p95_s=0.6, slo_ttft_s=0.5)) == 14


def test_forecast_policy_looks_one_cold_start_ahead_and_keeps_warm_buffer() -> None:
    calls = []

    def forecast(t: float) -> float:
        calls.append(t)
        return 100.0 if t >= 300 else 10.0  # a ramp arrives in 5 minutes

    policy = ForecastPolicy(ScalingGuard(max_replicas=1000), forecast_need=forecast, cold_start_s=lambda: 300.0,
                            warm_buffer=3, replica_seconds_per_request=0.5, target_load=0.8)
    desired = policy.decide(state(0, 5, load=0.5))
    assert desired == 63 + 3  # ceil(100 req/s * 0.5 s / 0.8) + warm buffer
    assert max(calls) == 300.0


def test_forecast_policy_adds_capacity_only_for_urgent_batch() -> None:
    policy = ForecastPolicy(ScalingGuard(max_replicas=1000), forecast_need=lambda t: 0.0, cold_start_s=lambda: 60.0,
                            warm_buffer=0, replica_seconds_per_request=1.0, target_load=0.8)
    quiet = policy.decide(PoolState(0, 10, 0, Signals(model="m", serving=10, load=0.4)))
    urgent = policy.decide(PoolState(10, 10, 0, Signals(model="m", serving=10, load=0.4), batch_required=8.0))
    assert urgent > quiet
    assert urgent == 15  # ceil((4 busy + 8 batch) / 0.8)
