"""The fluid fleet simulation: per-step aggregates for every scaled unit under one policy.

A unit is one (region, model) pool, or, under the `disaggregated` policy, its prefill pool and its decode
pool. Each step (default 10 s): replicas finish cold starts / drains; arrivals are served by the serving
replicas (overload becomes a fluid backlog); the queueing model (autoscale/queueing.py) gives TTFT
statistics and per-tier SLO attainment; batch work fills spare capacity (tier-aware policies, with
overflow to the other region) or joins the queue on arrival (the baselines); a node can fail at the
peak; the policy reads the unit's Signals and the fleet scales toward its answer.
"""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoscale.capacity import ModelProfile, replicas_for_work
from autoscale.forecast import LoadForecaster
from autoscale.placement import Cluster
from autoscale.policy import (ForecastPolicy, GpuUtilPolicy, Policy, PoolState, ScalingGuard, SignalsPolicy,
                              StaticPolicy)
from autoscale.queueing import TtftModel
from autoscale.signals import Signals
from autoscale.simulator.architecture import (ARCHITECTURES, ArchitectureChoice, choose_architecture, daily_forecast,
                                              planned_peak_gpus)
from autoscale.simulator.batch import BatchQueue
from autoscale.simulator.costs import UnitCost, unit_costs
from autoscale.simulator.fleet import PoolFleet
from autoscale.simulator.settings import OURS_ARCHITECTURES, POLICIES, TIER_AWARE, Region, SimSettings
from autoscale.simulator.summary import SimResult, summarise
from autoscale.simulator.workload import DAY_S, PoolTraffic, WorkloadModel

log = logging.getLogger(__name__)
BATCH_FILL_UTILISATION = 0.92  # batch fills serving replicas up to this busy fraction
BATCH_HOLD_FRACTION = 0.5  # non-preemptive engines: share of admitted batch work still running next step
PLANNER_STEP_S = 60.0  # resolution of the forecast day the architecture choice is planned on

__all__ = ["SimInputs", "SimResult", "Unit", "prepare", "run_simulation", "simulate"]


@dataclass
class Unit:
    """One scaled pool: which (region, model) pair it serves, in which role, at what cost."""

    pair: int
    region: Region
    model: ModelProfile
    cost: UnitCost

    @property
    def role(self) -> str:
        return self.cost.role


@dataclass
class SimInputs:
    """Everything that does not depend on the policy: time grid, traffic, forecasts, costs (built once)."""

    settings: SimSettings
    workload: WorkloadModel
    t_s: np.ndarray
    measure_from: int  # first step index of the measured window (after warm-up)
    traffic: list[PoolTraffic]
    history_end_s: float
    forecasters: list[LoadForecaster] | None = None
    costs: dict[str, list[list[UnitCost]]] | None = None  # architecture -> per pair -> units
    choices: list[ArchitectureChoice] | None = None  # per pair: ours' architecture (from the capacity model)

    def architectures(self, policy: str) -> list[str]:
        """Per (region, model) pair: how the policy serves it (ours: its per-pool choice)."""
        pairs = len(self.settings.pools())
        if policy == "disaggregated":
            return ["disaggregated"] * pairs
        if policy == "ours":
            forced = self.settings.ours_architecture
            if forced not in OURS_ARCHITECTURES:
                raise ValueError(f"ours_architecture {forced!r}: choose from {OURS_ARCHITECTURES}")
            return [forced] * pairs if forced != "auto" else [c.architecture for c in self.choices]
        return ["colocated"] * pairs

    def units(self, policy: str) -> list[Unit]:
        archs = self.architectures(policy)
        return [Unit(k, region, model, cost) for k, (region, model) in enumerate(self.settings.pools())
                for cost in self.costs[archs[k]][k]]

    def choose_architectures(self) -> None:
        """Ours' per-pool choice, planned on the forecast of the measured day (else the smooth curve)."""
        s, m = self.settings, self.measure_from
        every = max(1, int(round(PLANNER_STEP_S / s.step_s)))
        pools = s.pools()
        profiles = [daily_forecast(self.forecasters[k] if self.forecasters else None,
                                   float(self.t_s[m] - self.history_end_s), every * s.step_s,
                                   self.traffic[k].smooth_requests_per_s[m::every]) for k in range(len(pools))]
        fit = {}  # (region, architecture) -> share of the planned peak GPUs the region holds
        for region in s.regions:
            for arch in ARCHITECTURES:
                peak = sum(planned_peak_gpus(self.costs[arch][k], model, float(profiles[k].max()), s.serving)
                           for k, (r, model) in enumerate(pools) if r.name == region.name)
                fit[region.name, arch] = region.nodes * region.gpus_per_node / max(peak, 1e-9)
        self.choices = []
        for k, (region, model) in enumerate(pools):
            batch = float(self.traffic[k].batch_submitted_per_s[m:].sum() * s.step_s)
            self.choices.append(choose_architecture({a: self.costs[a][k] for a in ARCHITECTURES}, model, profiles[k],
                                                    every * s.step_s, batch, self.workload.prompts,
                                                    s.workload.output_tokens_mean, s.serving,
                                                    {a: fit[region.name, a] for a in ARCHITECTURES}))


def prepare(settings: SimSettings, with_forecast: bool = True) -> SimInputs:
    wl = WorkloadModel(settings)
    day0 = (settings.history_weeks * 7 + settings.start_day) * DAY_S
    start = day0 - settings.warmup_h * 3600.0
    t = np.arange(start, day0 + settings.horizon_h * 3600.0, settings.step_s)
    pools = settings.pools()
    traffic = [wl.pool_traffic(t, region, model.traffic_share, settings.seed * 1000 + i)
               for i, (region, model) in enumerate(pools)]
    inputs = SimInputs(settings, wl, t, int(round(settings.warmup_h * 3600.0 / settings.step_s)), traffic, start)
    w, sv = settings.workload, settings.serving
    inputs.costs = {arch: [unit_costs(model, settings.prefix, arch, wl.prompts.mean, w.output_tokens_mean,
                                      w.interactive_share, float(tr.smooth_requests_per_s.max()),
                                      sv.sizing_target_utilisation, sv.stream_tokens_per_s)
                           for (_, model), tr in zip(pools, traffic)]
                    for arch in ("colocated", "disaggregated")}
    if with_forecast:
        inputs.forecasters = []
        for i, (region, model) in enumerate(pools):
            hist = wl.hourly_history(region, model.traffic_share, start, settings.history_weeks, settings.seed * 1000 + 500 + i)
            horizon = int(math.ceil((t[-1] - start) / 3600.0)) + 12
            inputs.forecasters.append(LoadForecaster().fit(hist, horizon_h=horizon))
    inputs.choose_architectures()
    return inputs


def _make_policy(name: str, inputs: SimInputs, unit: Unit, fleet: PoolFleet, static_n: int, fleet_max: int,
                 forecaster: LoadForecaster | None) -> Policy:
    model = unit.model
    if name == "static":
        return StaticPolicy(static_n)
    if name == "reactive-gpu-util":
        return GpuUtilPolicy(ScalingGuard(min_replicas=1, max_replicas=fleet_max, down_cooldown_s=300,
                                          down_window_s=300, down_step_fraction=1.0, down_step_interval_s=15))
    if name == "reactive-signals":
        return SignalsPolicy(ScalingGuard(min_replicas=1, max_replicas=fleet_max, up_cooldown_s=30, down_cooldown_s=300,
                                          down_window_s=300, down_step_fraction=0.1, down_step_interval_s=60))
    if name in TIER_AWARE:
        guard = ScalingGuard(min_replicas=max(2, model.min_idle_replicas), max_replicas=fleet_max, down_cooldown_s=600,
                             down_window_s=300, down_step_fraction=0.05, down_step_interval_s=120)
        return ForecastPolicy(guard, forecast_need=lambda now: float(forecaster.predict(now - inputs.history_end_s)),
                              cold_start_s=fleet.cold_start_estimate, warm_buffer=model.min_idle_replicas,
                              replica_seconds_per_request=unit.cost.w_fg,
                              burst_buffer_fraction=float(inputs.settings.serving.burst_buffer_fraction))
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


def _twins(units: list[Unit]) -> list[int | None]:
    """For each unit, the same model and role in another region (batch overflow goes there)."""
    return [next((j for j, v in enumerate(units) if v.model.name == u.model.name and v.role == u.role
                  and v.region.name != u.region.name), None) for u in units]


def run_simulation(policy: str, settings: SimSettings, inputs: SimInputs | None = None,
                   progress: Callable[[int], None] | None = None) -> SimResult:
    """Simulate one policy over the horizon; `inputs` can be shared between policies of one comparison."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    tier_aware = policy in TIER_AWARE  # preempts batch within one iteration; scales on interactive signals + deadlines
    inputs = inputs or prepare(settings, with_forecast=tier_aware)
    if tier_aware and inputs.forecasters is None:
        raise ValueError(f"the {policy!r} policy needs inputs prepared with_forecast=True")
    s, wl, sv = settings, settings.workload, settings.serving
    units = inputs.units(policy)
    U, dt, t = len(units), s.step_s, inputs.t_s
    pair = np.array([u.pair for u in units])
    prompts = inputs.workload.prompts
    slo_mask = (prompts.tokens <= sv.slo_prompt_tokens_max).astype(float)
    std_mask = (prompts.tokens <= sv.standard_slo_prompt_tokens_max).astype(float)
    w = np.array([u.cost.w_fg for u in units])
    w_b = np.array([u.cost.w_batch for u in units])
    prefill = np.array([u.cost.prefill_effective_tokens_per_s for u in units])
    decode = np.array([u.cost.decode_effective_tokens_per_s for u in units])
    interference = np.array([sv.decode_interference if u.role == "colocated" else 0.0 for u in units])
    gpus = np.array([u.model.gpus_per_replica for u in units])
    kv_cap = np.array([u.model.kv_capacity_tokens for u in units])
    token_share = np.array([u.cost.token_share for u in units])
    counts_requests = np.array([u.role != "decode" for u in units], dtype=float)  # SLO counted once per request
    decode_twin = [next((j for j, v in enumerate(units) if v.pair == u.pair and v.role == "decode"), None)
                   if u.role == "prefill" else None for u in units]
    twins = _twins(units) if tier_aware and sv.batch_overflow else [None] * U
    tok_per_req = prompts.mean + wl.output_tokens_mean
    ttft = TtftModel(prompts.tokens, prompts.prob, slo_mask, wl.output_tokens_mean, prefill, decode, np.ones(U),
                     sv.router_choice_width, interference, sv.iteration_s, sv.slo_ttft_s,
                     [(std_mask, sv.standard_slo_ttft_s)])
    rng = np.random.default_rng(s.seed + 99)
    cluster = Cluster({r.name: (r.nodes, r.gpus_per_node) for r in s.regions})
    fleets = [PoolFleet(u.region.name, u.model, cluster, rng, sv.drain_s) for u in units]
    measured = slice(inputs.measure_from, len(t))
    forecasters = [copy.deepcopy(inputs.forecasters[u.pair]) for u in units] if tier_aware else [None] * U
    policies: list[Policy] = []
    for k, u in enumerate(units):
        tr = inputs.traffic[u.pair]
        static_n = replicas_for_work(float(tr.smooth_requests_per_s[measured].max()) * w[k], sv.sizing_target_utilisation)
        fleet_max = u.region.nodes * u.region.gpus_per_node // u.model.gpus_per_replica
        policies.append(_make_policy(policy, inputs, u, fleets[k], static_n, fleet_max, forecasters[k]))
        start_n = static_n if policy == "static" else max(
            replicas_for_work(tr.smooth_requests_per_s[0] * w[k], sv.sizing_target_utilisation), 2)
        fleets[k].bootstrap(start_n + (u.model.min_idle_replicas if tier_aware else 0))

    n = len(t)
    fg_rates = np.stack([tr.requests_per_s for tr in inputs.traffic], axis=1)[:, pair]
    batch_rates = np.stack([tr.batch_submitted_per_s for tr in inputs.traffic], axis=1)[:, pair]
    rec = {key: np.zeros((n, U)) for key in ("alloc_gpus", "busy_gpus", "demand_gpus", "interactive", "slo_met",
                                              "standard", "standard_met", "tokens", "batch_tokens", "serving",
                                              "ttft_p95")}
    backlog = np.zeros(U)
    held = np.zeros(U)  # batch work started last step that a non-preemptive engine must finish first
    queues = [BatchQueue() for _ in range(U)]
    overflow_work = np.zeros(U)
    failure = _failure_plan(s, inputs)
    for i in range(n):
        now = t[i]
        if failure and i in failure["events"]:
            failure["events"][i](cluster, fleets)
        for f in fleets:
            f.advance(now)
        serving = np.array([len(f.serving) for f in fleets], dtype=float)
        lam_fg, lam_b = fg_rates[i], batch_rates[i]
        for k in range(U):
            if lam_b[k] > 0:
                queues[k].submit(now + wl.batch_deadline_h * 3600.0, lam_b[k] * w_b[k] * dt)
        batch_waiting = np.array([1.0 if q.waiting else 0.0 for q in queues])
        fg_capacity = serving if tier_aware else np.maximum(serving - np.minimum(held / dt, serving), 0.0)
        extra = batch_waiting * sv.batch_preempt_s if tier_aware else np.zeros(U)
        for k, j in enumerate(decode_twin):  # a disaggregated request also waits for a decode slot
            if j is not None:
                extra[k] += backlog[j] / max(serving[j], 1.0)
        q = ttft.step(lam_fg, fg_capacity, backlog, extra)
        demand = lam_fg * w * dt + backlog
        done = np.minimum(fg_capacity * dt, demand)
        backlog = demand - done
        spare = np.maximum(serving * BATCH_FILL_UTILISATION * dt - done - held, 0.0)
        batch_done = np.array([queues[k].take(spare[k]) for k in range(U)])
        for k, j in enumerate(twins):  # overflow: leftover spare here serves the other region's backlog
            if j is not None and spare[k] - batch_done[k] > 1e-9 and queues[j].waiting:
                moved = queues[j].take((spare[k] - batch_done[k]) * w_b[j] / w_b[k]) * w_b[k] / w_b[j]
                batch_done[k] += moved
                overflow_work[k] += moved
        for qk in queues:
            qk.expire(now)
        # Non-preemptive engines (baselines): half of the batch admitted now is still decoding next step
        # and holds capacity interactive arrivals cannot take. Tier-aware policies preempt, so nothing is held.
        hold = 0.0 if tier_aware else BATCH_HOLD_FRACTION
        progress_now = held + batch_done * (1.0 - hold)
        held = batch_done * hold
        rec["alloc_gpus"][i] = [f.allocated_gpus for f in fleets]
        rec["busy_gpus"][i] = (done + progress_now) / dt * gpus
        rec["demand_gpus"][i] = lam_fg * w * gpus
        rec["interactive"][i] = lam_fg * wl.interactive_share * dt * counts_requests
        rec["slo_met"][i] = rec["interactive"][i] * q.slo_attainment
        rec["standard"][i] = lam_fg * (1.0 - wl.interactive_share) * dt * counts_requests
        rec["standard_met"][i] = rec["standard"][i] * q.extra_attainment[0]
        rec["tokens"][i] = done / w * tok_per_req * token_share
        rec["batch_tokens"][i] = progress_now / w_b * tok_per_req * token_share
        rec["serving"][i] = serving
        rec["ttft_p95"][i] = q.ttft_p95_s
        stream_s = wl.output_tokens_mean / sv.stream_tokens_per_s
        conc = lam_fg / np.maximum(serving, 1) * (q.mean_ttft_s + stream_s)
        if not tier_aware:  # tier-blind signals see batch streams as load too
            conc = conc + progress_now / dt / np.maximum(serving, 1) / w_b * stream_s
        kv = np.minimum(conc * (prompts.mean + wl.output_tokens_mean / 2) / kv_cap, 1.0)
        duty = np.where(progress_now > 0, 1.0, 1.0 - np.exp(-conc))
        seen_work = lam_fg * w + (0 if tier_aware else progress_now / dt)
        load = np.minimum(seen_work / np.maximum(serving, 1e-9), 1.0)
        for k, f in enumerate(fleets):
            sig = Signals(model=f.model.name, serving=int(serving[k]), kv_utilisation=float(kv[k]),
                          running=float(conc[k] * serving[k]), waiting=float(backlog[k] > 1e-6),
                          ttft_p95_s=float(q.ttft_p95_s[k]), queue_wait_p95_s=float(q.queue_wait_p95_s[k]),
                          requests_per_s=float(lam_fg[k]), load=float(load[k]), gpu_util=float(duty[k]),
                          slo_ttft_s=sv.slo_ttft_s)
            req = 0.0
            if tier_aware:
                forecasters[k].observe(now - inputs.history_end_s, float(lam_fg[k]), dt)
                req = queues[k].required_rate(now)
            state = PoolState(now, len(f.serving), len(f.starting), sig, req)
            desired = policies[k].decide(state)
            if tier_aware and desired > f.total:  # ours reads the inventory: never asks for GPUs that are not there
                room = f.total + cluster.free_replicas(f.region, f.model.gpus_per_replica)
                if desired > room:
                    f.capacity_limited_steps += 1
                    desired = room
            f.scale_to(desired, now)
        if progress and i % 360 == 0:
            progress(min(360, n - i))
    return summarise(policy, settings, inputs, units, rec, fleets, queues, overflow_work, failure)


def _failure_plan(s: SimSettings, inputs: SimInputs) -> dict | None:
    """One node of the configured region fails at the measured day's global peak and is repaired later."""
    cfg = s.failure
    if cfg is None:
        return None
    m = inputs.measure_from
    total = sum(tr.smooth_requests_per_s for tr in inputs.traffic)
    at = m + int(np.argmax(total[m:])) if cfg.get("at", "peak") == "peak" else m + int(float(cfg["at"]) * 3600 / s.step_s)
    repair = min(at + int(float(cfg.get("repair_h", 4.0)) * 3600 / s.step_s), len(inputs.t_s) - 1)
    plan = {"region": cfg["region"], "step": at, "t_h": (inputs.t_s[at] - inputs.t_s[m]) / 3600.0,
            "repair_t_h": (inputs.t_s[repair] - inputs.t_s[m]) / 3600.0, "replicas_lost": 0, "gpus_lost": 0}

    def fail(cluster: Cluster, fleets: list[PoolFleet]) -> None:
        plan["node"] = node = cluster.busiest_node(cfg["region"])
        plan["gpus_lost"] = int(cluster.regions[cfg["region"]].used[node].sum())
        for f in fleets:
            if f.region == cfg["region"]:
                plan["replicas_lost"] += f.lose_node(node)
        cluster.fail_node(cfg["region"], node)
        log.info("node %s-node-%03d failed at hour %.2f: %d replicas, %d GPUs lost", cfg["region"], node,
                 plan["t_h"], plan["replicas_lost"], plan["gpus_lost"])

    def repair_node(cluster: Cluster, _fleets: list[PoolFleet]) -> None:
        cluster.repair_node(cfg["region"], plan["node"])

    plan["events"] = {at: fail, repair: repair_node}
    return plan


def simulate(policies: list[str], settings: SimSettings, progress: Callable[[str, int, int], None] | None = None
             ) -> dict[str, SimResult]:
    """Compare policies on one workload (same traffic, same seed)."""
    inputs = prepare(settings, with_forecast=any(p in TIER_AWARE for p in policies))
    out = {}
    for name in policies:
        cb = (lambda adv, _n=name: progress(_n, adv, len(inputs.t_s))) if progress else None
        out[name] = run_simulation(name, settings, inputs, cb)
    return out
