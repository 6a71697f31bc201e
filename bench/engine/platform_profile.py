"""Where the whole platform's CPU goes during a burst: `fleet up` as bench_engine's `platform` system runs it (one
replica, the router, broker, usage loader, metrics scraper, admin UI), then bursts of 32 streams x 128 tokens
through the router, and for each burst the CPU seconds every process spent, the router's dispatch times
(`fleet_router_dispatch_seconds`: arrival to the upstream call), the router's and the engine's mean TTFT, and
the client's throughput / TTFT / TPOT. `--idle-s` also measures what the platform's processes spend idle.

The platform's own services share the replica's cores; on 2 cores whose two OpenMP threads spin through every
step, CPU they take stalls the step (docs/benchmarks.md, Engine / CPU). Run alone, as every benchmark here.

    python -m bench.engine.platform_profile --rounds 2 --idle-s 10
    python -m bench.engine.platform_profile --env GOMP_SPINCOUNT=20000 --stream-interval 8
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import psutil

from bench.engine.bench_engine import PLATFORM_MODEL, RESULTS, platform_up, wait_quiet
from bench.engine.peers import run_triton, summarize
from bench.engine.workload import make_burst
from common.settings import load_settings

# process roles by command line (first match wins)
ROLES = [("replica (python backend stub)", "triton_python_backend_stub"), ("tritonserver", "tritonserver"),
         ("router", "-m router_service"), ("usage loader", "usage load"), ("metrics scraper", "scrape-metrics"),
         ("broker (tansu)", "tansu"), ("admin UI (streamlit)", "streamlit"), ("this client", "platform_profile")]


def role(cmdline: str) -> str | None:
    return next((name for name, tag in ROLES if tag in cmdline), None)


def cpu_by_role() -> dict[str, float]:
    out: dict[str, float] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            name = role(" ".join(p.info["cmdline"] or []))
            if name:
                t = p.cpu_times()
                out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.Error:
            pass
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items(), key=lambda kv: -kv[1])}


def histogram(text: str, name: str) -> dict:
    """count, sum and cumulative buckets of one Prometheus histogram (all label sets added up)."""
    count = total = 0.0
    buckets: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"count": count, "sum": total, "buckets": buckets}


def since(after: dict, before: dict) -> dict:
    """What a histogram gained between two scrapes: count, mean (ms) and how many within 50 ms."""
    n = after["count"] - before["count"]
    within = after["buckets"].get("0.05", 0.0) - before["buckets"].get("0.05", 0.0)
    return {"count": n, "mean_ms": (after["sum"] - before["sum"]) / n * 1000 if n else None, "within_50ms": within}


def gained(before: str, after: str, name: str) -> dict:
    """`since` for histogram `name` between two scrapes' texts."""
    return since(histogram(after, name), histogram(before, name))


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def replica_metrics_url() -> str | None:
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "tritonserver":
            for arg in p.info["cmdline"] or []:
                if arg.startswith("--metrics-port="):
                    return f"http://127.0.0.1:{arg.split('=', 1)[1]}/metrics"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="bursts (the first meets a cold prefix cache; later "
                                                          "ones reuse the same prompts' cached blocks)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--idle-s", type=float, default=0.0, help="also measure the idle platform's CPU over this long")
    ap.add_argument("--stream-interval", type=int, default=0, help="engine stream_interval (0 = its default)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="extra environment for `fleet up`")
    ap.add_argument("--out", type=Path, help="JSON report (default bench/results/platform-profile-<time>.json)")
    args = ap.parse_args()
    settings = load_settings()
    knobs = argparse.Namespace(kv_blocks=4096, step_tokens=256, threads=2, cpu_matmul="auto", cpu_kernels="auto",
                               stream_interval=args.stream_interval)
    extra = dict(kv.split("=", 1) for kv in args.env)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": [round(x, 2) for x in os.getloadavg()],
              "streams": args.streams, "tokens": args.tokens, "env": extra,
              "stream_interval": args.stream_interval or "default", "bursts": []}
    print("fleet up ...", flush=True)
    with platform_up(settings, args.streams, knobs, "platform-profile-", extra) as platform:
        grpc_url, api_key = platform.grpc_url, platform.api_key
        router_metrics = f"http://127.0.0.1:{platform.env['FLEET_ROUTER_HTTP_PORT']}/metrics"
        replica_metrics = replica_metrics_url()
        if args.idle_s:
            wait_quiet("the platform")
            before = cpu_by_role()
            time.sleep(args.idle_s)
            report["idle_cpu_s_per_s"] = {k: round(v / args.idle_s, 4) for k, v in delta(cpu_by_role(), before).items()}
            print(f"idle, CPU-s per s: {report['idle_cpu_s_per_s']}", flush=True)
        burst = make_burst(args.streams, output_tokens=args.tokens)
        for r in range(args.rounds):
            quiet = wait_quiet("the platform")
            m0 = scrape(router_metrics)
            e0 = scrape(replica_metrics) if replica_metrics else ""
            cpu0, t0 = cpu_by_role(), time.time()
            s = summarize(run_triton(grpc_url, burst, args.streams, PLATFORM_MODEL, api_key))
            wall, cpu1 = time.time() - t0, cpu_by_role()
            m1 = scrape(router_metrics)
            e1 = scrape(replica_metrics) if replica_metrics else ""
            row = {"round": r, "wall_s": round(wall, 3), **quiet,
                   **{k: s[k] for k in ("errors", "throughput_tok_s", "ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50")},
                   "cpu_s": delta(cpu1, cpu0),
                   "router_dispatch": gained(m0, m1, "fleet_router_dispatch_seconds"),
                   "router_ttft": gained(m0, m1, "fleet_router_ttft_seconds"),
                   "engine_ttft": gained(e0, e1, "fleet_engine_ttft_seconds") if replica_metrics else None}
            report["bursts"].append(row)
            print(json.dumps(row), flush=True)
    out = args.out or RESULTS / f"platform-profile-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
