"""Per-pool serving architecture: colocated replicas, or split prefill and decode pools.

"Ours" decides this per (region, model) pool before the day, from the capacity model, as NVIDIA
Dynamo's planner decides disaggregation from profiled curves. For each architecture it plans the day
the way the forecast policy will scale it, on the pool's forecast demand:

    planned replicas(t) = max(min replicas, ceil(need(t) / target)) + max(warm buffer, ceil(burst share x need(t)))
    need(t) = forecast requests/s x replica-seconds per interactive/standard request (after prefix reuse)

summed over the architecture's units (one colocated pool, or a prefill and a decode pool, each with its
own floor and warm buffer), plus the day's batch work at the target utilisation. The choice is the
architecture with the fewer planned replica-seconds per request (interactive, standard and batch) among
those that hold, at the peak design point, the interactive TTFT SLO (queueing model, >= 99 % of eligible
requests) and the per-stream speed target (the capacity model's bound). The design point is the planned
peak replicas, or the share of them the region's GPUs hold if the region's pools, all served that way,
would not fit (a plan the fleet cannot hold does not hold the SLO either); if neither architecture holds
both, the cheaper one. A split pool saves the decode
step's fixed cost on every prefill token; a colocated one has one floor and one warm buffer instead of
two and, on large pools, a larger prefix cache per request: the per-request saving wins on busy pools,
the fixed part on small ones.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from autoscale.capacity import ModelProfile
from autoscale.queueing import ttft_stats
from autoscale.simulator.costs import UnitCost
from autoscale.simulator.settings import Serving
from autoscale.simulator.workload import PromptBins

ARCHITECTURES = ("colocated", "disaggregated")
SLO_ATTAINMENT_REQUIRED = 0.99
MIN_REPLICAS = 2  # the forecast policy's floor per scaled unit (ScalingGuard min_replicas)


@dataclass(frozen=True)
class ArchitectureChoice:
    """One pool's chosen architecture and the planned cost and design-point SLO of both candidates."""

    architecture: str  # colocated | disaggregated
    replica_seconds_per_request: dict[str, float]  # planned, per architecture (floors and buffers included)
    per_request_work: dict[str, float]  # the capacity model alone: interactive/standard replica-s per request
    design_point_slo: dict[str, float]  # interactive TTFT SLO attainment at the peak, per architecture
    stream_tokens_per_s: dict[str, float]
    eligible: dict[str, bool]
    fleet_fit: dict[str, float]  # share of the planned peak the region holds (1 = fits)

    def as_dict(self) -> dict:
        return asdict(self)


def planned_replicas(unit: UnitCost, model: ModelProfile, fg_per_s: np.ndarray, serving: Serving) -> np.ndarray:
    """Replicas the forecast policy holds for one unit along a demand profile: need at the target
    utilisation (at least the floor) plus the warm buffer (registry minimum or a burst share of the need)."""
    burst_share = serving.burst_buffer_fraction * model.cold_start_s[1] / 180.0
    need = np.ceil(fg_per_s * unit.w_fg / serving.sizing_target_utilisation - 1e-9)
    buffer = np.maximum(model.min_idle_replicas, np.ceil(burst_share * need))
    return np.maximum(max(MIN_REPLICAS, model.min_idle_replicas), need) + buffer


def planned_replica_seconds(units: list[UnitCost], model: ModelProfile, fg_per_s: np.ndarray, dt_s: float,
                            batch_requests: float, serving: Serving) -> float:
    """Replica-seconds one architecture's units hold over the profile, plus the batch work at the target."""
    return sum(float(planned_replicas(u, model, fg_per_s, serving).sum() * dt_s)
               + batch_requests * u.w_batch / serving.sizing_target_utilisation for u in units)


def planned_peak_gpus(units: list[UnitCost], model: ModelProfile, peak_per_s: float, serving: Serving) -> float:
    """GPUs one architecture's units hold at the forecast peak."""
    return sum(float(planned_replicas(u, model, np.array([peak_per_s]), serving)[0]) for u in units) \
        * model.gpus_per_replica


def design_point_slo(units: list[UnitCost], model: ModelProfile, peak_per_s: float, prompts: PromptBins,
                     output_mean: float, serving: Serving, fleet_fit: float = 1.0) -> float:
    """Interactive TTFT SLO attainment at the forecast peak on the replicas the plan holds there, or on
    the share `fleet_fit` of them that the region's GPUs hold when the plan does not fit."""
    share = min(fleet_fit, 1.0)
    held = [float(planned_replicas(u, model, np.array([peak_per_s]), serving)[0]) * share for u in units]
    if any(peak_per_s * u.w_fg >= n for u, n in zip(units, held)):
        return 0.0  # the peak's work exceeds what is held: the backlog grows, nothing meets the SLO
    front, replicas = units[0], held[0]  # the unit a request enters: the colocated pool, or the prefill pool
    slo_mask = (prompts.tokens <= serving.slo_prompt_tokens_max).astype(float)
    interference = serving.decode_interference if front.role == "colocated" else 0.0
    q = ttft_stats(np.array([peak_per_s]), np.array([replicas]), np.zeros(1), prompts.tokens, prompts.prob,
                   slo_mask, output_mean, np.array([front.prefill_effective_tokens_per_s]),
                   np.array([front.decode_effective_tokens_per_s]), np.ones(1), serving.router_choice_width,
                   interference, serving.iteration_s, serving.slo_ttft_s, np.zeros(1))
    return float(q.slo_attainment[0])


def choose_architecture(costs: dict[str, list[UnitCost]], model: ModelProfile, fg_per_s: np.ndarray, dt_s: float,
                        batch_requests: float, prompts: PromptBins, output_mean: float, serving: Serving,
                        fleet_fit: dict[str, float] | None = None) -> ArchitectureChoice:
    """Colocated or disaggregated for one pool over one forecast day (`fg_per_s` sampled every `dt_s`).

    `fleet_fit`: per architecture, the share of the region's planned peak GPUs the region has (<= 1 when
    the region's pools, all served that way, would not fit); the design-point SLO is taken on that share."""
    fleet_fit = fleet_fit or {}
    requests = float(fg_per_s.sum() * dt_s) + batch_requests
    planned, work, slo, speed, ok = {}, {}, {}, {}, {}
    for arch in ARCHITECTURES:
        units = costs[arch]
        planned[arch] = planned_replica_seconds(units, model, fg_per_s, dt_s, batch_requests, serving) / max(requests, 1.0)
        work[arch] = sum(u.w_fg for u in units)
        slo[arch] = design_point_slo(units, model, float(fg_per_s.max()), prompts, output_mean, serving,
                                     fleet_fit.get(arch, 1.0))
        speed[arch] = min(u.stream_tokens_per_s for u in units)
        reaches_speed = all(u.bound != "unreachable-speed" for u in units)
        ok[arch] = slo[arch] >= SLO_ATTAINMENT_REQUIRED and reaches_speed
    candidates = [a for a in ARCHITECTURES if ok[a]] or list(ARCHITECTURES)  # neither holds: the cheaper one
    best = min(candidates, key=lambda a: (planned[a], a != "colocated"))
    return ArchitectureChoice(best, planned, work, slo, speed, ok, {a: min(fleet_fit.get(a, 1.0), 1.0) for a in ARCHITECTURES})


def daily_forecast(forecaster, start_s: float, dt_s: float, smooth_fallback: np.ndarray) -> np.ndarray:
    """The pool's interactive/standard requests/s over the next day as the planner sees it: the
    forecaster's curve from `start_s` (seconds after its history), else the pool's smooth curve."""
    if forecaster is None:
        return np.asarray(smooth_fallback, dtype=float)
    steps = int(math.ceil(86400.0 / dt_s))
    return np.asarray(forecaster.predict(start_s + dt_s * np.arange(steps)), dtype=float)
