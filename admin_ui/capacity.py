"""The capacity page's data: one simulated day of the fleet (autoscale/simulator) for a chosen policy.

The simulator is imported lazily so the rest of the UI works when it is missing or broken; the page
then says "simulator not available" with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

UTILISATION_TARGET = 0.60  # finance's target, averaged over a day (docs/architecture.md, Goals)
FALLBACK_POLICIES = ("static", "reactive-gpu-util", "reactive-signals", "ours")


@dataclass(frozen=True)
class CapacityRequest:
    """What the page lets the user choose."""

    policy: str = "ours"
    horizon_h: float = 24.0
    step_s: float = 60.0
    seed: int = 7
    peak_requests_per_s: float | None = None  # None = the assumptions file's value
    interactive_share: float | None = None
    batch_enabled: bool = True


@dataclass(frozen=True)
class CapacityResult:
    summary: dict
    hourly: pd.DataFrame
    pools: pd.DataFrame


class SimulatorUnavailable(RuntimeError):
    """The fleet simulator cannot be imported or does not have the expected interface."""


def policies() -> tuple[str, ...]:
    try:
        from autoscale.simulator.settings import POLICIES
    except Exception:  # the simulator is optional for the rest of the UI
        return FALLBACK_POLICIES
    return tuple(POLICIES)


def simulator_problem() -> str | None:
    """None when the simulator can be used, else why not."""
    try:
        from autoscale.simulator.engine import run_simulation  # noqa: F401
        from autoscale.simulator.settings import SimSettings  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def default_workload() -> dict:
    """The assumptions file's workload numbers (for the page's defaults)."""
    try:
        from autoscale.simulator.settings import SimSettings
        return dict(SimSettings().assumptions["workload"])
    except Exception:
        return {}


def run_capacity(req: CapacityRequest) -> CapacityResult:
    """Simulate the day; raises SimulatorUnavailable when the simulator is missing."""
    problem = simulator_problem()
    if problem:
        raise SimulatorUnavailable(problem)
    from autoscale.simulator.engine import run_simulation
    from autoscale.simulator.settings import SimSettings

    settings = SimSettings(horizon_h=req.horizon_h, step_s=req.step_s, seed=req.seed, batch_enabled=req.batch_enabled)
    workload = settings.assumptions["workload"]
    if req.peak_requests_per_s is not None:
        scale = req.peak_requests_per_s / workload["peak_requests_per_s"]
        workload["peak_requests_per_s"] = req.peak_requests_per_s
        workload["requests_per_day"] = workload["requests_per_day"] * scale
        workload["batch_requests_per_day"] = workload["batch_requests_per_day"] * scale
    if req.interactive_share is not None:
        workload["interactive_share"] = req.interactive_share
    result = run_simulation(req.policy, settings)
    hourly = result.hourly.copy()
    hourly["utilisation_target"] = UTILISATION_TARGET
    return CapacityResult(summary=dict(result.summary), hourly=hourly, pools=pd.DataFrame(result.pools))
