"""Fleet simulator: the issue's measured targets on a full simulated day, and the API the admin UI uses."""
from __future__ import annotations

import pytest

from autoscale.capacity import peak_sizing
from autoscale.simulator.engine import run_simulation, simulate
from autoscale.simulator.settings import POLICIES, SimSettings


@pytest.fixture(scope="module")
def day() -> dict:
    # A full day (+ warm-up) at 20-s steps keeps the test fast; `fleet simulate` uses 10-s steps.
    return simulate(list(POLICIES), SimSettings(step_s=20.0))


def test_peak_estimate_from_assumptions_is_about_1350_gpus() -> None:
    s = SimSettings()
    sizing = peak_sizing(s.models, 3500, 2000, 300, s.serving.sizing_target_utilisation)
    assert sizing.total_gpus == pytest.approx(1350, rel=0.05)
    assert sizing.gpus["large-70b-fp8"] % 4 == 0


def test_ours_meets_utilisation_and_slo_targets(day: dict) -> None:
    ours = day["ours"].summary
    assert ours["daily_avg_utilisation"] >= 0.70
    assert ours["interactive_slo_attainment"] >= 0.99
    assert ours["batch_requests_missed_deadline"] == 0


def test_ours_beats_every_policy_on_tokens_per_gpu_hour_at_equal_or_better_slo(day: dict) -> None:
    ours = day["ours"].summary
    for name, result in day.items():
        if name == "ours":
            continue
        other = result.summary
        assert ours["tokens_per_gpu_hour"] > other["tokens_per_gpu_hour"], name
        assert ours["interactive_slo_attainment"] >= other["interactive_slo_attainment"] - 1e-4, name


def test_ours_peak_sizing_agrees_with_the_estimate(day: dict) -> None:
    ours = day["ours"].summary
    assert abs(ours["peak_vs_estimate"]) <= 0.10, ours


def test_utilisation_percent_is_the_wrong_signal(day: dict) -> None:
    gpu_util, signals = day["reactive-gpu-util"].summary, day["reactive-signals"].summary
    assert gpu_util["gpu_hours"] > 2 * signals["gpu_hours"]
    assert gpu_util["daily_avg_utilisation"] < 0.5


def test_run_simulation_api_for_the_capacity_page() -> None:
    settings = SimSettings(horizon_h=3.0, warmup_h=1.0, step_s=30.0)
    result = run_simulation("reactive-signals", settings)
    assert list(result.hourly["hour"]) == [0, 1, 2]
    for column in ("gpus_allocated", "utilisation", "slo_attainment", "cost_usd", "gpu_hours", "tokens"):
        assert column in result.hourly
    assert len(result.timeline) == 3 * 60
    with pytest.raises(ValueError):
        run_simulation("nope", settings)
