"""The fluid fleet simulation: per-step aggregates for every (region, model) pool under one policy.

Each step (default 10 s): replicas finish cold starts / drains; arrivals are served by the serving
replicas (overload becomes a fluid backlog); the queueing model (autoscale/queueing.py) gives TTFT
statistics and SLO attainment; batch work fills spare capacity (ours) or joins the queue on arrival
(the baselines); the policy reads the pool's Signals and the fleet scales toward its answer.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from autoscale.capacity import peak_sizing, replicas_for_work
from autoscale.forecast import LoadForecaster
from autoscale.placement import Cluster
from autoscale.policy import (ForecastPolicy, GpuUtilPolicy, Policy, PoolState, ScalingGuard, SignalsPolicy,
                              StaticPolicy)
from autoscale.queueing import ttft_stats
from autoscale.signals import Signals
from autoscale.simulator.fleet import PoolFleet
from autoscale.simulator.settings import POLICIES, SimSettings
from autoscale.simulator.workload import DAY_S, PoolTraffic, WorkloadModel

log = logging.getLogger(__name__)
BATCH_FILL_UTILISATION = 0.92  # batch fills serving replicas up to this busy fraction
BATCH_HOLD_FRACTION = 0.5  # non-preemptive engines: share of admitted batch work still running next step


@dataclass
class SimInputs:
    """Everything that does not depend on the policy: time grid, traffic, forecasts (built once)."""

    settings: SimSettings
    workload: WorkloadModel
    t_s: np.ndarray
    measure_from: int  # first step index of the measured window (after warm-up)
    traffic: list[PoolTraffic]
    history_end_s: float
    forecasters: list[LoadForecaster] | None = None


def prepare(settings: SimSettings, with_forecast: bool = True) -> SimInputs:
    wl = WorkloadModel(settings)
    day0 = (settings.history_weeks * 7 + settings.start_day) * DAY_S
    start = day0 - settings.warmup_h * 3600.0
    t = np.arange(start, day0 + settings.horizon_h * 3600.0, settings.step_s)
    traffic = [wl.pool_traffic(t, region, model.traffic_share, settings.seed * 1000 + i)
               for i, (region, model) in enumerate(settings.pools())]
    inputs = SimInputs(settings, wl, t, int(round(settings.warmup_h * 3600.0 / settings.step_s)), traffic, start)
    if with_forecast:
        inputs.forecasters = []
        for i, (region, model) in enumerate(settings.pools()):
            hist = wl.hourly_history(region, model.traffic_share, start, settings.history_weeks, settings.seed * 1000 + 500 + i)
            horizon = int(math.ceil((t[-1] - start) / 3600.0)) + 12
            inputs.forecasters.append(LoadForecaster().fit(hist, horizon_h=horizon))
    return inputs


@dataclass
class SimResult:
    """One policy's run: headline numbers, per-hour table and a per-minute timeline (for plots/UI)."""

    policy: str
    summary: dict
    hourly: pd.DataFrame
    timeline: pd.DataFrame
    pools: list[dict] = field(default_factory=list)


def _make_policy(name: str, inputs: SimInputs, k: int, fleet: PoolFleet, static_n: int, fleet_max: int) -> Policy:
    model = inputs.settings.models[k % len(inputs.settings.models)]
    if name == "static":
        return StaticPolicy(static_n)
    if name == "reactive-gpu-util":
        return GpuUtilPolicy(ScalingGuard(min_replicas=1, max_replicas=fleet_max, down_cooldown_s=300,
                                          down_window_s=300, down_step_fraction=1.0, down_step_interval_s=15))
    if name == "reactive-signals":
        return SignalsPolicy(ScalingGuard(min_replicas=1, max_replicas=fleet_max, up_cooldown_s=30, down_cooldown_s=300,
                                          down_window_s=300, down_step_fraction=0.1, down_step_interval_s=60))
    if name == "ours":
        fc = inputs.forecasters[k]
        wl = inputs.settings.workload
        w = model.replica_seconds(inputs.workload.prompts.mean, wl.output_tokens_mean)
        guard = ScalingGuard(min_replicas=max(2, model.min_idle_replicas), max_replicas=fleet_max, down_cooldown_s=600,
                             down_window_s=300, down_step_fraction=0.05, down_step_interval_s=120)
        return ForecastPolicy(guard, forecast_need=lambda now: float(fc.predict(now - inputs.history_end_s)),
                              cold_start_s=fleet.cold_start_estimate, warm_buffer=model.min_idle_replicas,
                              replica_seconds_per_request=w,
                              burst_buffer_fraction=float(inputs.settings.serving.burst_buffer_fraction))
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


BATCH_URGENT_S = 4 * 3600.0


def _batch_required(buckets: list[list[float]], now: float) -> float:
    """Replica-s/s the batch backlog needs so every bucket due within BATCH_URGENT_S meets its deadline
    (EDF feasibility). Work due later is left to spare capacity (nights), so batch never adds to the peak."""
    need, cum = 0.0, 0.0
    for deadline, remaining in buckets:
        cum += remaining
        if deadline - now <= BATCH_URGENT_S:
            need = max(need, cum / max(deadline - now, 60.0))
    return need


def run_simulation(policy: str, settings: SimSettings, inputs: SimInputs | None = None,
                   progress: Callable[[int], None] | None = None) -> SimResult:
    """Simulate one policy over the horizon; `inputs` can be shared between policies of one comparison."""
    inputs = inputs or prepare(settings, with_forecast=(policy == "ours"))
    if policy == "ours" and inputs.forecasters is None:
        raise ValueError("the 'ours' policy needs inputs prepared with_forecast=True")
    s, wl, sv = settings, settings.workload, settings.serving
    pools = s.pools()
    K, dt, t = len(pools), s.step_s, inputs.t_s
    prompts = inputs.workload.prompts
    slo_mask = (prompts.tokens <= sv.slo_prompt_tokens_max).astype(float)
    models = [m for _, m in pools]
    w = np.array([m.replica_seconds(prompts.mean, wl.output_tokens_mean) for m in models])
    tok_per_req = prompts.mean + wl.output_tokens_mean
    prefill = np.array([m.prefill_tokens_per_s for m in models])
    decode = np.array([m.decode_tokens_per_s for m in models])
    cfactor = np.array([m.compute_factor for m in models])
    gpus = np.array([m.gpus_per_replica for m in models])
    kv_cap = np.array([m.kv_capacity_tokens for m in models])
    rng = np.random.default_rng(s.seed + 99)
    cluster = Cluster({r.name: (r.nodes, r.gpus_per_node) for r in s.regions})
    fleets = [PoolFleet(region.name, model, cluster, rng, sv.drain_s) for region, model in pools]
    tier_aware = policy == "ours"  # preempts batch within seconds; scales on interactive signals + batch deadlines
    measured = slice(inputs.measure_from, len(t))
    policies: list[Policy] = []
    for k, (region, model) in enumerate(pools):
        tr = inputs.traffic[k]
        static_n = replicas_for_work(float(tr.smooth_requests_per_s[measured].max()) * w[k], sv.sizing_target_utilisation)
        fleet_max = region.nodes * region.gpus_per_node // model.gpus_per_replica
        policies.append(_make_policy(policy, inputs, k, fleets[k], static_n, fleet_max))
        start_n = static_n if policy == "static" else max(
            replicas_for_work(tr.smooth_requests_per_s[0] * w[k], sv.sizing_target_utilisation), 2)
        fleets[k].bootstrap(start_n + (model.min_idle_replicas if tier_aware else 0))

    n = len(t)
    fg_rates = np.stack([tr.requests_per_s for tr in inputs.traffic], axis=1)
    batch_rates = np.stack([tr.batch_submitted_per_s for tr in inputs.traffic], axis=1)
    rec = {key: np.zeros((n, K)) for key in ("alloc_gpus", "busy_gpus", "demand_gpus", "interactive", "slo_met",
                                              "tokens", "batch_tokens", "serving", "ttft_p95")}
    backlog = np.zeros(K)
    held = np.zeros(K)  # batch work started last step that a non-preemptive engine must finish first
    batch_buckets: list[list[list[float]]] = [[] for _ in range(K)]
    batch_missed = np.zeros(K)
    for i in range(n):
        now = t[i]
        for f in fleets:
            f.advance(now)
        serving = np.array([len(f.serving) for f in fleets], dtype=float)
        lam_fg, lam_b = fg_rates[i], batch_rates[i]
        for k in range(K):
            if lam_b[k] > 0:
                deadline = now + wl.batch_deadline_h * 3600.0
                bk = batch_buckets[k]
                if bk and bk[-1][0] > deadline - 900.0:
                    bk[-1][1] += lam_b[k] * w[k] * dt
                else:
                    bk.append([deadline, lam_b[k] * w[k] * dt])
        batch_waiting = np.array([1.0 if bk else 0.0 for bk in batch_buckets])
        fg_capacity = serving if tier_aware else np.maximum(serving - np.minimum(held / dt, serving), 0.0)
        q = ttft_stats(lam_fg, fg_capacity, backlog, prompts.tokens, prompts.prob, slo_mask, wl.output_tokens_mean,
                       prefill, decode, cfactor, sv.router_choice_width, sv.decode_interference, sv.iteration_s,
                       sv.slo_ttft_s, batch_waiting * sv.batch_preempt_s if tier_aware else np.zeros(K))
        demand = lam_fg * w * dt + backlog
        done = np.minimum(fg_capacity * dt, demand)
        backlog = demand - done
        spare = np.maximum(serving * BATCH_FILL_UTILISATION * dt - done - held, 0.0)
        batch_done = np.zeros(K)  # batch work admitted this step (taken off the backlog)
        for k in range(K):
            budget, bk = spare[k], batch_buckets[k]
            while bk and budget > 1e-9:
                take = min(budget, bk[0][1])
                bk[0][1] -= take
                budget -= take
                batch_done[k] += take
                if bk[0][1] <= 1e-9:
                    bk.pop(0)
            while bk and bk[0][0] < now:  # past its deadline: count as missed, keep serving it
                batch_missed[k] += bk[0][1] / w[k]
                bk[0][0] = math.inf
        # Non-preemptive engines (baselines): half of the batch admitted now is still decoding next step
        # and holds capacity interactive arrivals cannot take. Ours preempts, so nothing is held.
        hold = 0.0 if tier_aware else BATCH_HOLD_FRACTION
        progress_now = held + batch_done * (1.0 - hold)
        busy_work = done + progress_now
        held = batch_done * hold
        alloc = np.array([f.allocated_gpus for f in fleets], dtype=float)
        rec["alloc_gpus"][i] = alloc
        rec["busy_gpus"][i] = busy_work / dt * gpus
        rec["demand_gpus"][i] = lam_fg * w * gpus
        rec["interactive"][i] = lam_fg * wl.interactive_share * dt
        rec["slo_met"][i] = rec["interactive"][i] * q.slo_attainment
        rec["tokens"][i] = done / w * tok_per_req
        rec["batch_tokens"][i] = progress_now / w * tok_per_req
        rec["serving"][i] = serving
        rec["ttft_p95"][i] = q.ttft_p95_s
        conc = lam_fg / np.maximum(serving, 1) * (q.mean_ttft_s + wl.output_tokens_mean / sv.stream_tokens_per_s)
        if not tier_aware:  # tier-blind signals see batch streams as load too
            conc = conc + progress_now / dt / np.maximum(serving, 1) / w * wl.output_tokens_mean / sv.stream_tokens_per_s
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
                inputs.forecasters[k].observe(now - inputs.history_end_s, float(lam_fg[k]), dt)
                req = _batch_required(batch_buckets[k], now)
            state = PoolState(now, len(f.serving), len(f.starting), sig, req)
            f.scale_to(policies[k].decide(state), now)
        if progress and i % 360 == 0:
            progress(min(360, n - i))
    if policy == "ours":
        for fc in inputs.forecasters:
            fc.correction = 1.0
    return _summarise(policy, settings, inputs, rec, fleets, batch_buckets, batch_missed, w)


def _summarise(policy: str, s: SimSettings, inputs: SimInputs, rec: dict, fleets: list[PoolFleet],
               batch_buckets: list, batch_missed: np.ndarray, w: np.ndarray) -> SimResult:
    m = inputs.measure_from
    dt = s.step_s
    hours = (inputs.t_s[m:] - inputs.t_s[m]) / 3600.0
    alloc, busy = rec["alloc_gpus"][m:].sum(axis=1), rec["busy_gpus"][m:].sum(axis=1)
    inter, met = rec["interactive"][m:].sum(axis=1), rec["slo_met"][m:].sum(axis=1)
    tokens = rec["tokens"][m:].sum(axis=1) + rec["batch_tokens"][m:].sum(axis=1)
    gpu_hours = float(alloc.sum() * dt / 3600.0)
    price = float(s.assumptions.get("gpu_hour_price_usd", 2.5))
    sizing = peak_sizing(s.models, s.workload.peak_requests_per_s, inputs.workload.prompts.mean,
                         s.workload.output_tokens_mean, s.serving.sizing_target_utilisation)
    summary = {
        "policy": policy,
        "gpu_hours": gpu_hours,
        "daily_avg_utilisation": float(busy.sum() / alloc.sum()),
        "interactive_slo_attainment": float(met.sum() / inter.sum()),
        "tokens_total": float(tokens.sum()),
        "tokens_per_gpu_hour": float(tokens.sum() / gpu_hours),
        "peak_gpus_allocated": int(alloc.max()),
        "peak_gpus_allocated_5min": int(pd.Series(alloc).rolling(max(1, int(300 / dt))).mean().max()),
        "mean_gpus_allocated": float(alloc.mean()),
        "min_gpus_allocated": int(alloc.min()),
        "requirements_peak_estimate_gpus": sizing.total_gpus,
        "peak_hour_gpus_allocated": float(pd.Series(alloc).groupby(np.floor(hours).astype(int)).mean().max()),
        "peak_vs_estimate": float(pd.Series(alloc).groupby(np.floor(hours).astype(int)).mean().max() / sizing.total_gpus - 1.0),
        "peak_5min_vs_estimate": float(pd.Series(alloc).rolling(max(1, int(300 / dt))).mean().max() / sizing.total_gpus - 1.0),
        "cost_usd": gpu_hours * price,
        "replica_starts": int(sum(f.starts for f in fleets)),
        "replica_drains": int(sum(f.drains for f in fleets)),
        "placement_failures": int(sum(f.placement_failures for f in fleets)),
        "batch_requests_missed_deadline": float(batch_missed.sum()),
        "batch_backlog_requests_at_end": float(sum(sum(r for _, r in bk) / w[k] for k, bk in enumerate(batch_buckets))),
        "batch_tokens": float(rec["batch_tokens"][m:].sum()),
        "horizon_h": s.horizon_h,
    }
    frame = pd.DataFrame({"hour": np.floor(hours).astype(int), "alloc": alloc, "busy": busy, "inter": inter,
                          "met": met, "tokens": tokens})
    g = frame.groupby("hour")
    hourly = pd.DataFrame({
        "gpus_allocated": g["alloc"].mean(), "gpus_busy": g["busy"].mean(),
        "utilisation": g["busy"].sum() / g["alloc"].sum(), "slo_attainment": g["met"].sum() / g["inter"].sum(),
        "interactive_requests": g["inter"].sum(), "tokens": g["tokens"].sum(),
        "gpu_hours": g["alloc"].sum() * dt / 3600.0}).reset_index()
    hourly["cost_usd"] = hourly["gpu_hours"] * price
    per_min = max(1, int(round(60.0 / dt)))
    sl = slice(m, None, per_min)
    timeline = pd.DataFrame({"t_h": (inputs.t_s[sl] - inputs.t_s[m]) / 3600.0,
                             "gpus_allocated": rec["alloc_gpus"][sl].sum(axis=1),
                             "gpus_busy": rec["busy_gpus"][sl].sum(axis=1),
                             "gpus_demand": rec["demand_gpus"][sl].sum(axis=1),
                             "ttft_p95_s": rec["ttft_p95"][sl].max(axis=1)})
    for k, f in enumerate(fleets):
        timeline[f"gpus_{f.region}_{f.model.name}"] = rec["alloc_gpus"][sl, k]
        timeline[f"busy_{f.region}_{f.model.name}"] = rec["busy_gpus"][sl, k]
    pools = [{"region": f.region, "model": f.model.name, "starts": f.starts, "drains": f.drains,
              "peak_gpus": int(rec["alloc_gpus"][m:, k].max()),
              "slo_attainment": float(rec["slo_met"][m:, k].sum() / rec["interactive"][m:, k].sum())}
             for k, f in enumerate(fleets)]
    log.info("%s: util %.1f %%, SLO %.3f %%, %.0f GPU-h, %.0f tokens/GPU-h, peak %d GPUs", policy,
             100 * summary["daily_avg_utilisation"], 100 * summary["interactive_slo_attainment"], gpu_hours,
             summary["tokens_per_gpu_hour"], summary["peak_gpus_allocated"])
    return SimResult(policy, summary, hourly, timeline, pools)


def simulate(policies: list[str], settings: SimSettings, progress: Callable[[str, int, int], None] | None = None
             ) -> dict[str, SimResult]:
    """Compare policies on one workload (same traffic, same seed)."""
    inputs = prepare(settings, with_forecast="ours" in policies)
    out = {}
    for name in policies:
        cb = (lambda adv, _n=name: progress(_n, adv, len(inputs.t_s))) if progress else None
        out[name] = run_simulation(name, settings, inputs, cb)
    return out
