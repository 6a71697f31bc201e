"""One policy's run summarised: headline numbers, per-hour table, per-minute timeline, per-pool rows."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from autoscale.capacity import peak_sizing
from autoscale.simulator.settings import SimSettings

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    """One policy's run: headline numbers, per-hour table and a per-minute timeline (for plots/UI)."""

    policy: str
    summary: dict
    hourly: pd.DataFrame
    timeline: pd.DataFrame
    pools: list[dict] = field(default_factory=list)


def requirements_sizing(s: SimSettings, inputs) -> object:
    """The peak estimate: peak requests/s x colocated replica-seconds per request / target utilisation."""
    costs = {m.name: inputs.costs["colocated"][k][0].w_fg for k, (_, m) in enumerate(s.pools())}
    return peak_sizing(s.models, s.workload.peak_requests_per_s, costs, s.serving.sizing_target_utilisation)


def _pair_max(units, per_unit: np.ndarray) -> float:
    """Sum over (region, model) pairs of the max over the pair's units (a disaggregated request is pending
    while either half of it is)."""
    out: dict[int, float] = {}
    for u, value in zip(units, per_unit):
        out[u.pair] = max(out.get(u.pair, 0.0), float(value))
    return sum(out.values())


def _architecture(units) -> str:
    """colocated, disaggregated, or mixed (ours: some pools split, some not)."""
    kinds = {"colocated" if u.role == "colocated" else "disaggregated" for u in units}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def summarise(policy: str, s: SimSettings, inputs, units, rec: dict, fleets, queues, overflow_work: np.ndarray,
              failure: dict | None) -> SimResult:
    m, dt = inputs.measure_from, s.step_s
    hours = (inputs.t_s[m:] - inputs.t_s[m]) / 3600.0
    hour_idx = np.floor(hours).astype(int)
    alloc, busy = rec["alloc_gpus"][m:].sum(axis=1), rec["busy_gpus"][m:].sum(axis=1)
    inter, met = rec["interactive"][m:].sum(axis=1), rec["slo_met"][m:].sum(axis=1)
    std, std_met = rec["standard"][m:].sum(axis=1), rec["standard_met"][m:].sum(axis=1)
    tokens = rec["tokens"][m:].sum(axis=1) + rec["batch_tokens"][m:].sum(axis=1)
    gpu_hours = float(alloc.sum() * dt / 3600.0)
    price = float(s.assumptions.get("gpu_hour_price_usd", 2.5))
    sizing = requirements_sizing(s, inputs)
    w_b = np.array([u.cost.w_batch for u in units])
    per_hour_alloc = pd.Series(alloc).groupby(hour_idx).mean()
    rolling5 = pd.Series(alloc).rolling(max(1, int(300 / dt))).mean()
    pending = np.array([q.pending_work for q in queues]) / w_b
    end = inputs.t_s[-1]
    due_4h = np.array([q.due_within(end, 4 * 3600.0) for q in queues]) / w_b
    summary = {
        "policy": policy,
        "architecture": _architecture(units),
        "pool_architectures": {f"{u.region.name}_{u.model.name}": "colocated" if u.role == "colocated" else "disaggregated"
                               for u in units},
        "gpu_hours": gpu_hours,
        "daily_avg_utilisation": float(busy.sum() / alloc.sum()),
        "interactive_slo_attainment": float(met.sum() / inter.sum()),
        "standard_slo_attainment": float(std_met.sum() / std.sum()) if std.sum() > 0 else 1.0,
        "tokens_total": float(tokens.sum()),
        "tokens_per_gpu_hour": float(tokens.sum() / gpu_hours),
        "peak_gpus_allocated": int(alloc.max()),
        "peak_gpus_allocated_5min": int(rolling5.max()),
        "mean_gpus_allocated": float(alloc.mean()),
        "min_gpus_allocated": int(alloc.min()),
        "fleet_gpus": int(sum(r.nodes * r.gpus_per_node for r in s.regions)),
        "requirements_peak_estimate_gpus": sizing.total_gpus,
        "peak_hour_gpus_allocated": float(per_hour_alloc.max()),
        "peak_vs_estimate": float(per_hour_alloc.max() / sizing.total_gpus - 1.0),
        "peak_5min_vs_estimate": float(rolling5.max() / sizing.total_gpus - 1.0),
        "cost_usd": gpu_hours * price,
        "replica_starts": int(sum(f.starts for f in fleets)),
        "replica_drains": int(sum(f.drains for f in fleets)),
        "placement_failures": int(sum(f.placement_failures for f in fleets)),
        "capacity_limited_steps": int(sum(f.capacity_limited_steps for f in fleets)),
        "batch_requests_missed_deadline": _pair_max(units, np.array([q.missed_work for q in queues]) / w_b),
        "batch_backlog_requests_at_end": _pair_max(units, pending),
        "batch_backlog_due_within_4h_at_end": _pair_max(units, due_4h),
        "batch_overflow_requests": float((overflow_work / w_b).sum()),
        "batch_tokens": float(rec["batch_tokens"][m:].sum()),
        "horizon_h": s.horizon_h,
    }
    if failure:
        at = failure["step"] - m
        window = slice(max(at, 0), max(at, 0) + int(3600 / dt))
        summary["node_failure"] = {k: v for k, v in failure.items() if k not in ("events", "step")} | {
            "interactive_slo_attainment_next_hour": float(met[window].sum() / max(inter[window].sum(), 1e-9)),
            "replicas_lost": int(sum(f.lost_to_failure for f in fleets))}
    frame = pd.DataFrame({"hour": hour_idx, "alloc": alloc, "busy": busy, "inter": inter, "met": met, "tokens": tokens})
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
    pools = []
    for k, (u, f) in enumerate(zip(units, fleets)):
        name = f"{f.region}_{f.model.name}" + ("" if u.role == "colocated" else f"_{u.role}")
        timeline[f"gpus_{name}"] = rec["alloc_gpus"][sl, k]
        timeline[f"busy_{name}"] = rec["busy_gpus"][sl, k]
        counted = rec["interactive"][m:, k].sum()
        pools.append({"region": f.region, "model": f.model.name, "role": u.role, "starts": f.starts, "drains": f.drains,
                      "peak_gpus": int(rec["alloc_gpus"][m:, k].max()),
                      "slo_attainment": float(rec["slo_met"][m:, k].sum() / counted) if counted else None,
                      "replica_seconds_per_request": u.cost.w_fg, "stream_tokens_per_s": u.cost.stream_tokens_per_s,
                      "capacity_bound": u.cost.bound, "kv_transfer_ms": u.cost.kv_transfer_s * 1e3}
                     | {f"prefix_{k}": v for k, v in u.cost.reuse.items()})  # flat: the admin UI shows it as a table
    log.info("%s: util %.1f %%, SLO %.3f %% (standard %.3f %%), %.0f GPU-h, %.0f tokens/GPU-h, peak %d GPUs", policy,
             100 * summary["daily_avg_utilisation"], 100 * summary["interactive_slo_attainment"],
             100 * summary["standard_slo_attainment"], gpu_hours, summary["tokens_per_gpu_hour"],
             summary["peak_gpus_allocated"])
    return SimResult(policy, summary, hourly, timeline, pools)
