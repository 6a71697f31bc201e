"""Autoscaler fleet simulation benchmark: the five policies on the requirements' fleet, one run.

    python bench/autoscale/simulate.py            # -> bench/results/autoscale-simulation{,-reuse-sweep,-nobatch,-calibrated-h200}.json
                                                  #    + docs/img/autoscale-*.png
    python bench/autoscale/simulate.py --seeds 1 2 3   # + robustness over seeds -> bench/results/autoscale-seeds.json

The main run is `fleet simulate --reuse-sweep` (all policies; then ours with every pool colocated, the
reference for its per-pool architecture choice; then ours, ours-colocated and disaggregated at 0-80 % reuse);
then the same day without batch work, and with the small model calibrated from the two H200 measurements
(autoscale/simulator/calibration/: transformers, and bench/autoscale/gpu_decode_curve.py's CUDA-graph step). The seed sweep reruns the whole comparison per seed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autoscale.cli import main as cli_main  # noqa: E402


def seed_sweep(seeds: list[int], out: Path) -> dict:
    from autoscale.simulator.engine import simulate
    from autoscale.simulator.settings import POLICIES, SimSettings

    rows = []
    for seed in seeds:
        t0 = time.monotonic()
        results = simulate(list(POLICIES), SimSettings(seed=seed))
        for name, r in results.items():
            s = r.summary
            rows.append({"seed": seed, "policy": name, "utilisation": s["daily_avg_utilisation"],
                         "slo_attainment": s["interactive_slo_attainment"], "gpu_hours": s["gpu_hours"],
                         "standard_slo_attainment": s["standard_slo_attainment"],
                         "batch_missed": s["batch_requests_missed_deadline"],
                         "tokens_per_gpu_hour": s["tokens_per_gpu_hour"], "peak_hour_gpus": s["peak_hour_gpus_allocated"],
                         "peak_5min_gpus": s["peak_gpus_allocated_5min"], "peak_vs_estimate": s["peak_vs_estimate"],
                         "wall_s": time.monotonic() - t0})
        print(f"seed {seed} done in {time.monotonic() - t0:.0f} s", flush=True)
    payload = {"benchmark": "autoscale-simulation-seeds", "rows": rows}
    out.write_text(json.dumps(payload, indent=2))
    return payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[])
    args, rest = parser.parse_known_args()
    rc = cli_main(["simulate", "--reuse-sweep", *rest])
    cli_main(["simulate", "--no-batch", "--no-plots", "--no-progress",
              "--out", str(ROOT / "bench" / "results" / "autoscale-simulation-nobatch.json")])
    calibration = ROOT / "autoscale" / "simulator" / "calibration"
    for name, out in (("h200-8b-transformers.jsonl", "autoscale-simulation-calibrated-h200.json"),
                      ("h200-8b-plain-pytorch-graph.jsonl", "autoscale-simulation-calibrated-h200-graph.json")):
        cli_main(["simulate", "--no-plots", "--no-progress", "--policies", "ours,disaggregated",
                  "--calibrate", str(calibration / name), "--out", str(ROOT / "bench" / "results" / out)])
    if args.seeds:
        seed_sweep(args.seeds, ROOT / "bench" / "results" / "autoscale-seeds.json")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
