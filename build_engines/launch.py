"""Start Triton for one model version on this node: plain `tritonserver` for one GPU, or one MPI rank per GPU
for a tensor-parallel engine (TensorRT-LLM's leader mode, as tensorrtllm_backend's
scripts/launch_triton_server.py --world_size N does).

Rank 0 loads the whole repository and serves HTTP/gRPC/metrics; ranks 1..N-1 load only `tensorrt_llm` (their
executor workers join rank 0's over MPI). Every rank gets its own Python-backend shared-memory prefix so the
ranks' stubs do not collide. The container's entrypoint execs the planned command (PID 1 gets SIGTERM).

    python -m build_engines.launch --world-size 4 --model-repo /data/fleet/engines/llama-70b/1/model_repository

Tracing: with an OTLP/HTTP traces URL (`--trace-url`, default env FLEET_TRITON_OTLP_URL, e.g.
http://otel-collector.monitoring:4318/v1/traces) Triton runs with `--trace-config mode=opentelemetry`, one trace
per `rate` requests (from FLEET_TRACE_SAMPLE_RATIO: ratio 0.1 -> rate 10; a caller's sampled `traceparent`,
sent by the router as gRPC metadata, is continued by Triton's OpenTelemetry mode). Triton's exporter speaks
OTLP over HTTP, not the gRPC endpoint the router's FLEET_OTLP_ENDPOINT names, hence its own setting.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

ENGINE_MODEL = "tensorrt_llm"
TRACE_SERVICE = "llm-replica"   # service.name of Triton's spans


def trace_rate(sample_ratio: float) -> int:
    """Triton samples 1 of every `rate` requests; 0 = none (a ratio of 0 turns Triton's tracing off)."""
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"the trace sample ratio must be in [0, 1], got {sample_ratio}")
    return 0 if sample_ratio == 0 else max(1, round(1 / sample_ratio))


def trace_args(url: str, rate: int) -> list[str]:
    """Triton's OpenTelemetry tracing flags (empty when no URL or rate 0)."""
    if not url or rate <= 0:
        return []
    return ["--trace-config", "mode=opentelemetry", "--trace-config", f"rate={rate}", "--trace-config",
            "level=TIMESTAMPS", "--trace-config", f"opentelemetry,url={url}",
            "--trace-config", f"opentelemetry,resource=service.name={TRACE_SERVICE}"]


def plan_launch(world_size: int, model_repo: str, http_port: int = 8000, grpc_port: int = 8001,
                metrics_port: int = 8002, tritonserver: str = "tritonserver",
                exit_timeout_s: int = 60, trace_url: str = "", trace_sample_ratio: float = 1.0) -> list[str]:
    """The exact command line for `world_size` GPUs."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    tracing = trace_args(trace_url, trace_rate(trace_sample_ratio))

    def rank(i: int) -> list[str]:
        cmd = [tritonserver, f"--model-repository={model_repo}", f"--http-port={http_port}",
               f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", "--disable-auto-complete-config",
               f"--backend-config=python,shm-region-prefix-name=prefix{i}_", f"--exit-timeout-secs={exit_timeout_s}",
               "--metrics-config=histogram_latencies=true"]  # Triton's latency histograms: docs/observability.md
        if i == 0:  # the serving rank: the only one that receives requests
            cmd += tracing
        else:
            cmd += ["--model-control-mode=explicit", f"--load-model={ENGINE_MODEL}"]
        return cmd

    if world_size == 1:
        return rank(0)
    cmd = ["mpirun", "--allow-run-as-root"]
    for i in range(world_size):
        cmd += ["-n", "1", *rank(i), ":"]
    return cmd[:-1]


def main(argv: list[str] | None = None) -> int:
    from common.settings import load_settings

    settings = load_settings()
    ap = argparse.ArgumentParser(prog="python -m build_engines.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=1,
                    help="GPUs = tensor-parallel ranks (the engine's --tensor-parallel; default 1)")
    ap.add_argument("--model-repo", required=True, help="the version's Triton model repository")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--tritonserver", default="tritonserver", help="tritonserver binary (default on PATH)")
    ap.add_argument("--trace-url", default=settings.triton_otlp_url,
                    help="OTLP/HTTP traces URL for Triton's OpenTelemetry tracing (default env FLEET_TRITON_OTLP_URL; "
                         "empty = off)")
    ap.add_argument("--trace-sample-ratio", type=float,
                    default=settings.trace_sample_ratio,
                    help="share of requests traced (default env FLEET_TRACE_SAMPLE_RATIO, else 1)")
    ap.add_argument("--print", action="store_true", help="print the command instead of running it")
    args = ap.parse_args(argv)
    try:
        cmd = plan_launch(args.world_size, args.model_repo, args.http_port, args.grpc_port, args.metrics_port,
                          args.tritonserver, trace_url=args.trace_url, trace_sample_ratio=args.trace_sample_ratio)
    except ValueError as exc:
        ap.error(str(exc))
    if args.print:
        print(shlex.join(cmd))
        return 0
    print(f"launching {args.world_size} rank(s): {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
