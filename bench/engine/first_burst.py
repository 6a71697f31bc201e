"""Warm before ready, measured: the first 32-stream burst on a fresh platform vs the second, with the engine's
warm-up on (the default, 16 sequences before Triton reports ready) and off (FLEET_ENGINE_WARMUP_SEQS=0).

Each mode starts its own `fleet up` (one fresh replica), waits until the host is quiet (so the other start-up
work of `fleet up` — UI, loader, broker — is not what is measured), then sends a 32-stream burst twice through the
router (different prompts, so the second does not hit the first's prefix cache). Reported per mode: tokens/s and TTFT p95 of each burst and first/second ratios. Modes take turns over
`--repeats` rounds. Results: bench/results/first-burst-<time>.json.

    .venv/bin/python -m bench.engine.first_burst --repeats 1
"""
from __future__ import annotations

import argparse
import json
import time

from bench.engine.bench_engine import (PLATFORM_MODEL, RESULTS, _load_avg, build_workload, burst_engine_args,
                                       platform_up, wait_quiet)
from bench.engine.peers import run_triton, summarize
from common.settings import REPO_ROOT, load_settings

MODES = {"warm-up 16": {"FLEET_ENGINE_WARMUP_SEQS": "16"}, "warm-up off": {"FLEET_ENGINE_WARMUP_SEQS": "0"}}
KEYS = ("throughput_tok_s", "ttft_ms_p50", "ttft_ms_p95", "errors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output", type=int, default=128, help="output tokens per stream")
    cli = ap.parse_args()
    args = burst_engine_args(cli.output)
    settings = load_settings()
    # the second burst's prompts differ from the first's: the same prompts would hit the prefix cache
    bursts = [build_workload("burst", cli.streams, burst_engine_args(cli.output, seed)) for seed in (0, 1)]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for round_ in range(cli.repeats):
        for mode in (list(MODES) if round_ % 2 == 0 else list(MODES)[::-1]):
            with platform_up(settings, cli.streams, args, "bench-first-burst-", MODES[mode]) as p:
                state = wait_quiet(f"the fresh platform ({mode})")
                first, second = (summarize(run_triton(p.grpc_url, reqs, cli.streams, PLATFORM_MODEL, p.api_key))
                                 for reqs in bursts)
            run = {"first": {k: first[k] for k in KEYS}, "second": {k: second[k] for k in KEYS}, **state,
                   "tok_s_first_vs_second": first["throughput_tok_s"] / second["throughput_tok_s"],
                   "ttft_p95_first_vs_second": first["ttft_ms_p95"] / second["ttft_ms_p95"]}
            runs[mode].append(run)
            print(f"{mode}: {json.dumps(run)}", flush=True)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_end": _load_avg(), "streams": cli.streams,
              "output_tokens": cli.output, "runs": runs,
              "command": f"python -m bench.engine.first_burst --repeats {cli.repeats}"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"first-burst-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({"path": str(path.relative_to(REPO_ROOT))}))


if __name__ == "__main__":
    main()
