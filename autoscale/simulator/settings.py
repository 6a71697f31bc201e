"""Simulator settings: the calibratable assumptions file plus run parameters (horizon, step, seed)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from autoscale.capacity import ModelProfile
from autoscale.simulator.prefix import PrefixWorkload

DEFAULT_ASSUMPTIONS = Path(__file__).with_name("assumptions.json")
POLICIES = ("static", "reactive-gpu-util", "reactive-signals", "ours", "disaggregated")
TIER_AWARE = ("ours", "disaggregated")  # preempt batch, scale on interactive signals + batch deadlines
OURS_ARCHITECTURES = ("auto", "colocated", "disaggregated")


@dataclass(frozen=True)
class Region:
    name: str
    nodes: int
    gpus_per_node: int
    traffic_share: float
    utc_offset_h: float


@dataclass(frozen=True)
class Workload:
    requests_per_day: float
    peak_requests_per_s: float
    interactive_share: float
    prompt_tokens_mean: float
    prompt_tokens_sigma: float
    prompt_tokens_max: float
    output_tokens_mean: float
    night_floor: float
    peak_hour_local: float
    weekend_factor: float
    noise_sigma: float
    bursts_per_day_per_region: float
    burst_amplitude: tuple[float, float]
    burst_minutes: tuple[float, float]
    batch_requests_per_day: float
    batch_submit_hours_local: tuple[float, float]
    batch_deadline_h: float


@dataclass(frozen=True)
class Serving:
    slo_ttft_s: float
    slo_prompt_tokens_max: float
    stream_tokens_per_s: float
    router_choice_width: int
    decode_interference: float
    iteration_s: float
    batch_preempt_s: float
    drain_s: float
    sizing_target_utilisation: float
    burst_buffer_fraction: float = 0.0
    standard_slo_ttft_s: float = 2.0
    standard_slo_prompt_tokens_max: float = 32768
    batch_overflow: bool = True  # batch work a region cannot fit runs in the other region's spare capacity


@dataclass
class SimSettings:
    """Everything one simulation run needs. `assumptions` is the parsed assumptions JSON."""

    assumptions: dict = field(default_factory=lambda: json.loads(DEFAULT_ASSUMPTIONS.read_text()))
    horizon_h: float = 24.0
    warmup_h: float = 15.0  # from 09:00 the day before: the previous day's batch backlog is in flight
    step_s: float = 10.0
    seed: int = 7
    history_weeks: int = 3
    start_day: int = 2  # simulated day index in the week (0 = Monday); history precedes it
    batch_enabled: bool = True
    node_failure: bool = True  # one node fails at the measured day's peak (assumptions "failure")
    reuse_override: float | None = None  # fixed interactive/standard prefix reuse (the sensitivity sweep)
    ours_architecture: str = "auto"  # auto: ours chooses per pool (simulator/architecture.py); or force one

    @classmethod
    def from_file(cls, path: Path | None = None, **overrides) -> "SimSettings":
        raw = json.loads((path or DEFAULT_ASSUMPTIONS).read_text())
        return cls(assumptions=raw, **overrides)

    @property
    def models(self) -> list[ModelProfile]:
        return [ModelProfile.from_dict(m, self.assumptions.get("gpu")) for m in self.assumptions["models"]]

    @property
    def regions(self) -> list[Region]:
        return [Region(**r) for r in self.assumptions["regions"]]

    @property
    def workload(self) -> Workload:
        raw = dict(self.assumptions["workload"])
        for key in ("burst_amplitude", "burst_minutes", "batch_submit_hours_local"):
            raw[key] = tuple(raw[key])
        if not self.batch_enabled:
            raw["batch_requests_per_day"] = 0.0
        return Workload(**raw)

    @property
    def serving(self) -> Serving:
        return Serving(**self.assumptions["serving"])

    @property
    def prefix(self) -> PrefixWorkload:
        pw = PrefixWorkload.from_dict(self.assumptions.get("prefix"))
        return pw if self.reuse_override is None else replace(pw, override=self.reuse_override)

    @property
    def failure(self) -> dict | None:
        raw = self.assumptions.get("failure")
        return dict(raw) if raw and self.node_failure else None

    def pools(self) -> list[tuple[Region, ModelProfile]]:
        """One pool per (region, model): the unit that is scaled."""
        return [(region, model) for region in self.regions for model in self.models]
