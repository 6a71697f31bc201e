"""Prefix-reuse sensitivity sweep and the colocated-vs-disaggregated comparison plot.

`reuse_sweep` reruns the day with the interactive + standard prefix reuse fixed at each level (batch
stays at its own reuse) for the given policies; every level shares one workload and one set of
forecasts (reuse changes costs, not traffic). `plot_reuse_sweep` and `plot_disaggregated` write the
PNGs docs/benchmarks.md shows.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from autoscale.simulator.costs import unit_costs
from autoscale.simulator.engine import SimInputs, prepare, run_simulation
from autoscale.simulator.report import COLOURS, save_figure
from autoscale.simulator.settings import SimSettings
from autoscale.simulator.summary import SimResult

log = logging.getLogger(__name__)
DEFAULT_LEVELS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.8)
SWEEP_KEYS = ("gpu_hours", "tokens_per_gpu_hour", "daily_avg_utilisation", "interactive_slo_attainment",
              "standard_slo_attainment", "peak_gpus_allocated_5min", "requirements_peak_estimate_gpus",
              "batch_requests_missed_deadline", "batch_backlog_requests_at_end", "capacity_limited_steps")


def _with_reuse(settings: SimSettings, inputs: SimInputs, level: float) -> tuple[SimSettings, SimInputs]:
    """Same traffic and forecasts, costs recomputed at a fixed reuse level."""
    s = dataclasses.replace(settings, reuse_override=level)
    w, sv = s.workload, s.serving
    costs = {arch: [unit_costs(model, s.prefix, arch, inputs.workload.prompts.mean, w.output_tokens_mean,
                               w.interactive_share, float(tr.smooth_requests_per_s.max()),
                               sv.sizing_target_utilisation, sv.stream_tokens_per_s)
                    for (_, model), tr in zip(s.pools(), inputs.traffic)]
             for arch in ("colocated", "disaggregated")}
    swept = dataclasses.replace(inputs, settings=s, costs=costs)
    swept.choose_architectures()  # ours re-decides per pool at this reuse level
    return s, swept


def reuse_sweep(settings: SimSettings, policies: list[str], levels: tuple[float, ...] = DEFAULT_LEVELS,
                inputs: SimInputs | None = None) -> list[dict]:
    """One row per (reuse level, policy) with the headline numbers."""
    inputs = inputs or prepare(settings, with_forecast=True)
    rows = []
    for level in levels:
        s, inp = _with_reuse(settings, inputs, level)
        for policy in policies:
            t0 = time.monotonic()
            summary = run_simulation(policy, s, inp).summary
            rows.append({"reuse": level, "policy": policy, "wall_s": time.monotonic() - t0}
                        | {k: summary[k] for k in SWEEP_KEYS})
            log.info("reuse %.0f %% %s: %.0f GPU-h, %.2f M tokens/GPU-h, SLO %.3f %%", 100 * level, policy,
                     summary["gpu_hours"], summary["tokens_per_gpu_hour"] / 1e6, 100 * summary["interactive_slo_attainment"])
    return rows


def plot_reuse_sweep(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = [("gpu_hours", "GPU-hours per day", 1), ("tokens_per_gpu_hour", "M tokens per GPU-hour", 1e-6),
              ("peak_gpus_allocated_5min", "peak GPUs (5-min max)", 1)]
    for ax, (key, label, scale) in zip(axes, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = [r for r in rows if r["policy"] == policy]
            ax.plot([100 * r["reuse"] for r in pts], [r[key] * scale for r in pts], marker="o",
                    color=COLOURS.get(policy), label=policy)
        if key == "peak_gpus_allocated_5min":
            ax.axhline(1536, color="grey", ls="--", lw=1, label="fleet: 1,536 GPUs")
        ax.set(xlabel="prompt tokens served from cache (interactive + standard), %", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Prefix-reuse sensitivity (one simulated day, batch reuse 0 %)")
    return save_figure(fig, path)


def plot_disaggregated(results: dict[str, SimResult], path: Path) -> Path:
    """Colocated ours vs disaggregated pools: GPUs per role over the day and the headline numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, dis = results["ours"], results["disaggregated"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax1.plot(ours.timeline["t_h"], ours.timeline["gpus_allocated"], color=COLOURS["ours"], label="ours (colocated)")
    ax1.plot(dis.timeline["t_h"], dis.timeline["gpus_allocated"], color=COLOURS["disaggregated"], label="disaggregated: all")
    for role, ls in (("prefill", "--"), ("decode", ":")):
        cols = [c for c in dis.timeline if c.startswith("gpus_") and c.endswith(f"_{role}")]
        ax1.plot(dis.timeline["t_h"], dis.timeline[cols].sum(axis=1), color=COLOURS["disaggregated"], ls=ls,
                 label=f"disaggregated: {role} pools")
    ax1.set(xlabel="hour of the simulated day (UTC)", ylabel="GPUs allocated", title="GPUs over the day")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    names = ["ours", "disaggregated"]
    metrics = [("tokens_per_gpu_hour", 1e-6, "M tok/GPU-h"), ("daily_avg_utilisation", 100, "util %"),
               ("gpu_hours", 1e-3, "k GPU-h")]
    for i, (key, scale, label) in enumerate(metrics):
        vals = [results[n].summary[key] * scale for n in names]
        bars = ax2.bar([i - 0.2, i + 0.2], vals, width=0.4, color=[COLOURS[n] for n in names])
        for b, v in zip(bars, vals):
            ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(range(len(metrics)), [m[2] for m in metrics])
    ax2.set_title("green: ours colocated, blue: disaggregated")
    return save_figure(fig, path)
