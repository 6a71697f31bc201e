"""Tracing + JSON logs on vs off: tokens/s of the 32-stream burst through the whole platform (`fleet up`),
the two settings taking turns in one run (`--repeats` rounds, order alternating), the median of each.

"On" = every request traced (FLEET_TRACE_SAMPLE_RATIO=1) and exported over OTLP/gRPC to a real receiver in
this process (tests/observability/otlp_receiver.py, which decodes and keeps every span), and JSON logs; "off"
= the defaults of `make up` (no endpoint, text logs). Results: bench/results/observability-<time>.json.

    .venv/bin/python -m bench.observability.tracing_ab --repeats 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.engine.bench_engine import (PLATFORM_MODEL, RESULTS, _load_avg, build_workload, burst_engine_args,
                                       platform_up, wait_quiet)
from bench.engine.peers import run_triton, summarize
from common.settings import REPO_ROOT, load_settings
from tests.observability.otlp_receiver import OtlpReceiver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output", type=int, default=128, help="output tokens per stream")
    cli = ap.parse_args()
    args = burst_engine_args(cli.output)
    settings = load_settings()
    receiver = OtlpReceiver().start()
    modes = {"off": {}, "on": {"FLEET_OTLP_ENDPOINT": receiver.endpoint, "FLEET_TRACE_SAMPLE_RATIO": "1",
                              "FLEET_LOG_FORMAT": "json"}}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    reqs = build_workload("burst", cli.streams, args)
    for round_ in range(cli.repeats):
        for mode in (["off", "on"] if round_ % 2 == 0 else ["on", "off"]):
            with platform_up(settings, cli.streams, args, f"bench-trace-{mode}-", modes[mode]) as p:
                spans_before = len(receiver.spans)
                state = wait_quiet(f"the platform ({mode})")
                s = summarize(run_triton(p.grpc_url, reqs, cli.streams, PLATFORM_MODEL, p.api_key)) | state
                time.sleep(1.5)  # the batch span processor's last export
                s["spans_received"] = len(receiver.spans) - spans_before
            runs[mode].append(s)
            print(f"{mode}: {json.dumps({k: s[k] for k in ('throughput_tok_s', 'ttft_ms_p95', 'errors', 'spans_received', 'load_avg_before')})}",
                  flush=True)
    receiver.stop()
    median = {m: statistics.median(r["throughput_tok_s"] for r in rs) for m, rs in runs.items()}
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_end": _load_avg(), "streams": cli.streams,
              "output_tokens": cli.output, "runs": runs, "median_tok_s": median,
              "on_vs_off": median["on"] / median["off"] if median["off"] else None,
              "command": "python -m bench.observability.tracing_ab --repeats %d" % cli.repeats}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"observability-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({"median_tok_s": median, "on_vs_off": report["on_vs_off"],
                      "path": str(path.relative_to(REPO_ROOT))}))


if __name__ == "__main__":
    main()
