"""Prefix-reuse sensitivity sweep and the colocated-vs-disaggregated comparison plot.

`reuse_sweep` reruns the day with the interactive + standard prefix reuse fixed at each level (batch
stays at its own reuse) for the given policies and `ours-colocated` (ours with every pool colocated, the
reference its per-pool choice is made against; ours re-decides at each level); every level shares one
workload and one set of forecasts (reuse changes costs, not traffic). `plot_reuse_sweep` and
`plot_disaggregated` write the PNGs docs/benchmarks.md shows.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from autoscale.simulator.costs import unit_costs
from autoscale.simulator.engine import SimInputs, prepare, run_simulation
from autoscale.simulator.report import COLOURS, save_figure, write_json
from autoscale.simulator.settings import SimSettings
from autoscale.simulator.summary import SimResult

log = logging.getLogger(__name__)
DEFAULT_LEVELS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.8)
OURS_COLOCATED = "ours-colocated"  # ours with every pool colocated: the reference for its per-pool choice
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


def run_variant(variant: str, settings: SimSettings, inputs: SimInputs) -> SimResult:
    """A policy, or `ours-colocated`: ours with every pool colocated (the reference its choice is made against)."""
    if variant != OURS_COLOCATED:
        return run_simulation(variant, settings, inputs)
    forced = dataclasses.replace(settings, ours_architecture="colocated")
    return run_simulation("ours", forced, dataclasses.replace(inputs, settings=forced))


def reuse_sweep(settings: SimSettings, policies: list[str], levels: tuple[float, ...] = DEFAULT_LEVELS,
                inputs: SimInputs | None = None) -> list[dict]:
    """One row per (reuse level, policy or `ours-colocated`) with the headline numbers."""
    inputs = inputs or prepare(settings, with_forecast=True)
    rows = []
    for level in levels:
        s, inp = _with_reuse(settings, inputs, level)
        for policy in policies:
            t0 = time.monotonic()
            summary = run_variant(policy, s, inp).summary
            rows.append({"reuse": level, "policy": policy, "wall_s": time.monotonic() - t0,
                         "pool_architectures": summary["pool_architectures"]}
                        | {k: summary[k] for k in SWEEP_KEYS})
            log.info("reuse %.0f %% %s: %.0f GPU-h, %.2f M tokens/GPU-h, SLO %.3f %%", 100 * level, policy,
                     summary["gpu_hours"], summary["tokens_per_gpu_hour"] / 1e6, 100 * summary["interactive_slo_attainment"])
    return rows


def sweep_and_compare(settings: SimSettings, inputs: SimInputs, results: dict[str, SimResult],
                      levels: tuple[float, ...], out: Path, img_dir: Path | None) -> dict:
    """The benchmark's second part: ours with every pool colocated at the default reuse (the reference for
    its per-pool choice), then the reuse sweep of ours, ours-colocated and disaggregated; JSON + plots."""
    if inputs.forecasters is None:
        inputs = prepare(settings, with_forecast=True)
    colocated = run_variant(OURS_COLOCATED, settings, inputs)
    policies = [p for p in ("ours", OURS_COLOCATED, "disaggregated") if p in results or p == OURS_COLOCATED]
    rows = reuse_sweep(settings, policies, levels, inputs)
    payload = {"benchmark": "autoscale-reuse-sweep", "levels": list(levels), "rows": rows,
               "ours_colocated_at_default_reuse": colocated.summary}
    write_json(payload, out)
    if img_dir is not None:
        plot_reuse_sweep(rows, img_dir / "autoscale-reuse-sweep.png")
        if {"ours", "disaggregated"} <= set(results):
            plot_disaggregated(results, colocated, img_dir / "autoscale-disaggregated.png")
    return payload


def plot_reuse_sweep(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = [("gpu_hours", "GPU-hours per day", 1), ("tokens_per_gpu_hour", "M tokens per GPU-hour", 1e-6),
              ("peak_gpus_allocated_5min", "peak GPUs (5-min max)", 1)]
    for ax, (key, label, scale) in zip(axes, panels):
        for policy in sorted(dict.fromkeys(r["policy"] for r in rows), key=lambda p: p == "ours"):  # ours on top
            pts = [r for r in rows if r["policy"] == policy]
            ours = policy == "ours"  # drawn dashed with small markers: where it equals a peer, both show
            ax.plot([100 * r["reuse"] for r in pts], [r[key] * scale for r in pts], marker="o", ms=4 if ours else 8,
                    ls="--" if ours else "-", color=COLOURS.get(policy), label=policy)
        if key == "peak_gpus_allocated_5min":
            ax.axhline(1536, color="grey", ls="--", lw=1, label="fleet: 1,536 GPUs")
        ax.set(xlabel="prompt tokens served from cache (interactive + standard), %", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Prefix-reuse sensitivity (one simulated day, batch reuse 0 %)")
    return save_figure(fig, path)


def plot_disaggregated(results: dict[str, SimResult], colocated: SimResult, path: Path) -> Path:
    """Ours with every pool colocated vs every pool split (and ours' per-pool choice): GPUs per role over
    the day and the headline numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dis = results["disaggregated"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax1.plot(colocated.timeline["t_h"], colocated.timeline["gpus_allocated"], color=COLOURS[OURS_COLOCATED],
             label="ours, every pool colocated")
    ax1.plot(dis.timeline["t_h"], dis.timeline["gpus_allocated"], color=COLOURS["disaggregated"],
             label="every pool split: all GPUs")
    for role, ls in (("prefill", "--"), ("decode", ":")):
        cols = [c for c in dis.timeline if c.startswith("gpus_") and c.endswith(f"_{role}")]
        ax1.plot(dis.timeline["t_h"], dis.timeline[cols].sum(axis=1), color=COLOURS["disaggregated"], ls=ls,
                 label=f"every pool split: {role} pools")
    ax1.set(xlabel="hour of the simulated day (UTC)", ylabel="GPUs allocated", title="GPUs over the day")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    runs = {"ours, all colocated": colocated, "ours (its choice)": results["ours"], "disaggregated": dis}
    colours = [COLOURS[OURS_COLOCATED], COLOURS["ours"], COLOURS["disaggregated"]]
    metrics = [("tokens_per_gpu_hour", 1e-6, "M tok/GPU-h"), ("daily_avg_utilisation", 100, "util %"),
               ("gpu_hours", 1e-3, "k GPU-h")]
    width = 0.27
    for i, (key, scale, _) in enumerate(metrics):
        vals = [r.summary[key] * scale for r in runs.values()]
        bars = ax2.bar([i + (j - 1) * width for j in range(len(runs))], vals, width=width, color=colours,
                       label=list(runs) if i == 0 else None)
        for b, v in zip(bars, vals):
            ax2.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(range(len(metrics)), [m[2] for m in metrics])
    ax2.set_ylim(0, ax2.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax2.legend(fontsize=7, loc="upper center", ncol=3)
    ax2.set_title("headline numbers")
    return save_figure(fig, path)
