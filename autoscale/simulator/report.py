"""Results of a policy comparison: JSON for bench/results, PNG plots for docs, plotly figures for the UI."""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

from autoscale.simulator.engine import SimInputs, prepare
from autoscale.simulator.settings import SimSettings
from autoscale.simulator.summary import SimResult, requirements_sizing

log = logging.getLogger(__name__)
COLOURS = {"static": "#7f7f7f", "reactive-gpu-util": "#d62728", "reactive-signals": "#ff7f0e", "ours": "#2ca02c",
           "disaggregated": "#1f77b4", "ours-colocated": "#9467bd"}


def sizing_derivation(settings: SimSettings, inputs: SimInputs | None = None) -> dict:
    """The requirements' peak estimate, derived step by step from the capacity model and prefix reuse."""
    inputs = inputs or prepare(settings, with_forecast=False)
    wl = settings.workload
    sizing = requirements_sizing(settings, inputs)
    rows = []
    for k, (region, m) in enumerate(settings.pools()):
        if region.name != settings.regions[0].name:
            continue
        cost = inputs.costs["colocated"][k][0]
        rows.append({"model": m.name, "requests_per_s": sizing.requests_per_s[m.name],
                     "replica_seconds_per_request": cost.w_fg, "prefix_reuse": cost.reuse,
                     "stream_tokens_per_s": cost.stream_tokens_per_s, "capacity_bound": cost.bound,
                     "kv_capacity_tokens": m.kv_capacity_tokens, "kv_bytes_per_token": m.kv_bytes_per_token,
                     "decode_step_ms": [1e3 * x for x in m.step_curve(settings.serving.stream_tokens_per_s)],
                     "busy_replicas": sizing.busy_replicas[m.name], "replicas": sizing.replicas[m.name],
                     "gpus": sizing.gpus[m.name], "calibration": m.calibration or None})
    return {"peak_requests_per_s": wl.peak_requests_per_s, "prompt_tokens_mean": inputs.workload.prompts.mean,
            "output_tokens_mean": wl.output_tokens_mean, "target_utilisation": sizing.target_utilisation,
            "models": rows, "total_gpus": sizing.total_gpus}


def architecture_choices(settings: SimSettings, inputs: SimInputs | None) -> list[dict]:
    """Ours' per-pool choice and the planned cost / design-point SLO of both candidates."""
    if inputs is None or inputs.choices is None:
        return []
    return [{"region": region.name, "model": model.name} | choice.as_dict()
            for (region, model), choice in zip(settings.pools(), inputs.choices)]


def results_json(results: dict[str, SimResult], settings: SimSettings, wall_s: float,
                 inputs: SimInputs | None = None) -> dict:
    return {
        "benchmark": "autoscale-fleet-simulation",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
        "run": {"horizon_h": settings.horizon_h, "warmup_h": settings.warmup_h, "step_s": settings.step_s,
                "seed": settings.seed, "wall_s": wall_s, "batch_enabled": settings.batch_enabled,
                "load_avg": list(os.getloadavg()), "node_failure": settings.node_failure,
                "reuse_override": settings.reuse_override},
        "assumptions": settings.assumptions,
        "peak_sizing": sizing_derivation(settings, inputs),
        "ours_architecture_choice": architecture_choices(settings, inputs),
        "policies": {name: {"summary": r.summary, "pools": r.pools,
                            "hourly": r.hourly.round(4).to_dict(orient="records")} for name, r in results.items()},
    }


def write_json(payload: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    log.info("wrote %s", path)
    return path


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure as a PNG (tight layout) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)
    return path


def _ours_last(results: dict[str, SimResult]) -> list[tuple[str, SimResult]]:
    """Policies in drawing order, ours last (dashed): where it coincides with a peer both stay visible."""
    return sorted(results.items(), key=lambda item: item[0] == "ours")


def plot_pngs(results: dict[str, SimResult], out_dir: Path, prefix: str = "autoscale") -> list[Path]:
    """Three PNGs: GPUs over the day, hourly utilisation, and the headline comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(10, 4.5))
    any_result = next(iter(results.values()))
    ax.plot(any_result.timeline["t_h"], any_result.timeline["gpus_demand"], color="black", lw=1,
            label="interactive+standard work (busy GPUs)")
    for name, r in _ours_last(results):
        ax.plot(r.timeline["t_h"], r.timeline["gpus_allocated"], color=COLOURS.get(name), lw=1.5,
                ls="--" if name == "ours" else "-", label=f"{name}: allocated")
    ax.set(xlabel="hour of the simulated day (UTC)", ylabel="GPUs", title="GPUs allocated per policy over one day")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left")
    paths.append(out_dir / f"{prefix}-gpus-timeline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    for name, r in _ours_last(results):
        ax.plot(r.hourly["hour"], 100 * r.hourly["utilisation"], marker="o", ms=3, color=COLOURS.get(name), label=name,
                ls="--" if name == "ours" else "-")
    ax.axhline(60, color="grey", ls="--", lw=1, label="target > 60 % daily average")
    ax.set(xlabel="hour", ylabel="GPU utilisation (busy / allocated), %", ylim=(0, 100), title="Hourly GPU utilisation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(out_dir / f"{prefix}-utilisation-hourly.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    names = list(results)
    metrics = [("daily_avg_utilisation", "daily avg utilisation, %", 100), ("interactive_slo_attainment", "TTFT SLO attainment, %", 100),
               ("gpu_hours", "GPU-hours per day", 1), ("tokens_per_gpu_hour", "M tokens per GPU-hour", 1e-6)]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    for ax, (key, label, scale) in zip(axes, metrics):
        vals = [results[n].summary[key] * scale for n in names]
        ax.bar(range(len(names)), vals, color=[COLOURS.get(n) for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
        if key == "interactive_slo_attainment":
            ax.set_ylim(min(vals) - 0.5, 100.5)  # room for the value labels under the title
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.2f}" if scale != 1 else f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
    fig.suptitle("Policy comparison (same workload, one simulated day)")
    paths.append(out_dir / f"{prefix}-policy-comparison.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for p in paths:
        log.info("wrote %s", p)
    return paths


def plotly_timeline(results: dict[str, SimResult]):
    """Plotly figure of GPUs allocated over the day (for the admin UI's Capacity page)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    any_result = next(iter(results.values()))
    fig.add_trace(go.Scatter(x=any_result.timeline["t_h"], y=any_result.timeline["gpus_demand"], name="work (busy GPUs)",
                             line={"color": "black", "width": 1}))
    for name, r in results.items():
        fig.add_trace(go.Scatter(x=r.timeline["t_h"], y=r.timeline["gpus_allocated"], name=name,
                                 line={"color": COLOURS.get(name)}))
    fig.update_layout(xaxis_title="hour", yaxis_title="GPUs allocated", title="GPUs per policy over one day")
    return fig


def summary_table(results: dict[str, SimResult]) -> list[dict]:
    """Rows for a table/markdown: one per policy."""
    return [{"policy": n, "utilisation_%": round(100 * r.summary["daily_avg_utilisation"], 1),
             "slo_attainment_%": round(100 * r.summary["interactive_slo_attainment"], 3),
             "standard_slo_%": round(100 * r.summary["standard_slo_attainment"], 3),
             "gpu_hours": round(r.summary["gpu_hours"]), "tokens_per_gpu_hour_M": round(r.summary["tokens_per_gpu_hour"] / 1e6, 2),
             "peak_gpus_5min": r.summary["peak_gpus_allocated_5min"],
             "batch_missed_M": round(r.summary["batch_requests_missed_deadline"] / 1e6, 3),
             "batch_backlog_end_M": round(r.summary["batch_backlog_requests_at_end"] / 1e6, 2)}
            for n, r in results.items()]
