"""Engine benchmark on the CPU: the same workloads against our whole platform (`fleet up`: requests through the
router to one engine replica), our engine's replica alone (its Triton, no router), transformers `generate`
with static batches, and llama.cpp's `llama-server --parallel N`, one after another in one run, each with the
same CPU threads; the load average is recorded before every system's run.

Workloads (`--workloads`): `burst` = N chat-sized prompts (20-60 tokens) all sent at once, 128 output tokens
each; `poisson` = Poisson arrivals, prompts of 100-1,000 tokens (half share a 300-token system prompt), outputs
of 16-256 tokens. EOS ignored everywhere. Reports throughput (output tokens/s over the makespan), TTFT and
inter-token latency p50/p95, peak RSS of each system's processes, prefix-cache savings and KV overhead of our
engine. Writes bench/results/engine-<timestamp>.json and the `### CPU` part of docs/benchmarks.md's `## Engine`.
The GPU mode is bench/engine/gpu_bench.py.

    python -m bench.engine.bench_engine                        # burst at 32, Poisson at 32, 8, 1
    python -m bench.engine.bench_engine --workloads burst --concurrency 32 --systems platform,engine,hf,llama
    python -m bench.engine.bench_engine --repeats 3             # systems take turns, 3 runs each, medians count
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import torch

from bench.engine.peers import Result, combine_runs, run_llama_server, run_triton, summarize
from bench.engine.report_doc import cpu_section, replace_subsection
from bench.engine.workload import Request, make_burst, make_workload
from build_engines.cpu import smollm2_weights
from common.processes import free_port, stop_pid, throwaway_platform_env, wait_until
from common.settings import REPO_ROOT, load_settings
from common.vendor import tritonserver_running
from python_backends.engine.device import CPU_MATMULS, cpu_flags, cpu_has_bf16_units, cpu_matmul_kind

RESULTS = REPO_ROOT / "bench" / "results"
PLATFORM_MODEL = "smollm2-135m"   # the model `fleet up` registers


class RssSampler:
    """Peak summed RSS of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                p = psutil.Process(self.pid)
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                self.peak = max(self.peak, rss)
            except psutil.Error:
                pass
            self._stop.wait(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


QUIET_BUSY_PERCENT = 15.0


def wait_quiet(what: str, max_s: float = 90.0) -> dict:
    """Wait until this host's CPUs are mostly idle (under QUIET_BUSY_PERCENT busy over one second) before a
    system is measured; returns the host's state then (load average, last busy reading), recorded with the
    result. A platform that has just answered its first request is still warming tokenizers and starting its
    UI and usage loader, and the previous system's processes may still be exiting: on a 2-core EPYC, a burst
    sent right after `fleet up` had TTFT p50 3.8 s, the same burst once the host was quiet 0.8 s."""
    deadline = time.time() + max_s
    busy = psutil.cpu_percent(interval=1.0)
    while busy >= QUIET_BUSY_PERCENT and time.time() <= deadline:
        busy = psutil.cpu_percent(interval=1.0)
    if busy >= QUIET_BUSY_PERCENT:
        print(f"warning: CPUs still {busy:.0f} % busy after {max_s:.0f} s; measuring {what} anyway", flush=True)
    return {"load_avg_before": _load_avg(), "cpu_busy_before": busy}


def _load_avg() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def _metric(url: str, name: str) -> float | None:
    try:
        for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    except OSError:
        return None
    return None


def engine_env(concurrency: int, args) -> dict[str, str]:
    """The engine's settings for one level (FLEET_ENGINE_* overrides, read by the replica at start). The one
    replica owns the cores: said explicitly, as `auto` would pick `shared` (short OpenMP spins) were another
    tritonserver still running when it starts."""
    return {"FLEET_REPLICA_CPU_CORES": "dedicated",
            "FLEET_ENGINE_NUM_KV_BLOCKS": str(args.kv_blocks), "FLEET_ENGINE_MAX_NUM_SEQS": str(max(concurrency, 1)),
            "FLEET_ENGINE_MAX_NUM_BATCHED_TOKENS": str(args.step_tokens), "FLEET_ENGINE_THREADS": str(args.threads),
            "FLEET_ENGINE_CPU_MATMUL": args.cpu_matmul, "FLEET_ENGINE_CPU_KERNELS": args.cpu_kernels,
            "OMP_NUM_THREADS": str(args.threads),
            **({"FLEET_ENGINE_STREAM_INTERVAL": str(args.stream_interval)} if args.stream_interval else {})}


def hf_dtype(setting: str) -> str:
    """The transformers peer's dtype: `auto` gives it its faster choice on this CPU (bf16 only where the CPU
    multiplies bf16 natively; elsewhere torch's bf16 GEMM runs at a fraction of fp32's rate)."""
    if setting != "auto":
        return setting
    return "bf16" if cpu_has_bf16_units() else "fp32"


@dataclass
class RunningPlatform:
    env: dict[str, str]
    data_dir: Path
    api_key: str
    grpc_url: str


@contextlib.contextmanager
def platform_up(settings, concurrency: int, args, prefix: str,
                extra_env: dict[str, str] | None = None) -> Iterator[RunningPlatform]:
    """`fleet up` on a throwaway data dir (router, one engine replica, Kafka-protocol broker, usage loader,
    admin UI; autoscaler off, so the replica stays one) with the engine's settings for `concurrency`, once it has
    answered a first request through the router; `fleet down` after. The router's per-replica stream cap follows
    the level (as the engine's max_num_seqs does) and its first-token timeout is raised to 600 s so an
    overloaded level is measured, not cordoned."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=settings.data_dir))
    env = throwaway_platform_env(data_dir)
    env.update(FLEET_ROUTER_REPLICA_CONCURRENCY=str(max(concurrency, 1)),
               FLEET_ROUTER_FIRST_TOKEN_TIMEOUT_S="interactive=600,standard=600,batch=600",
               **engine_env(concurrency, args), **(extra_env or {}))

    def fleet(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleet.cli", *cmd], env=env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=900)
    up = fleet("up")
    try:
        if up.returncode:
            raise RuntimeError(f"fleet up failed:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
        platform = RunningPlatform(env, data_dir, (data_dir / "dev-api-key").read_text().strip(),
                                   f"127.0.0.1:{env['FLEET_ROUTER_GRPC_PORT']}")
        probe = [Request(idx=-1, arrival_s=0.0, prompt_ids=[1, 2, 3], max_tokens=2, shared_prefix=False)]
        wait_until(lambda: not run_triton(platform.grpc_url, probe, 1, PLATFORM_MODEL, platform.api_key)[0].error,
                   300, "a first request through the router")
        yield platform
    finally:
        fleet("down")


def bench_platform(settings, workloads: dict, args) -> dict:
    """The whole platform as callers meet it (`platform_up`): every request through the router's KServe gRPC
    stream with the dev API key, standard tier."""
    out = {}
    for key, (conc, reqs) in workloads.items():
        with platform_up(settings, conc, args, f"bench-platform-{key}-") as p:
            before = wait_quiet("the platform")
            s = summarize(run_triton(p.grpc_url, reqs, conc, PLATFORM_MODEL, p.api_key)) | before
        out[key] = s
        print(f"platform {key}: {json.dumps(s)}", flush=True)
    return out


def bench_engine(settings, weights: Path, workloads: dict, args) -> dict:
    from build_engines.triton_repo import cpu_values, render_repository
    from common.services import start_triton

    out = {}
    run_dir = settings.data_dir / "bench-engine"
    repo = render_repository(run_dir / "repo", cpu_values(weights, REPO_ROOT / "adapters" / "smollm2-135m", 2048,
                                                          args.dtype), steps=("engine",))
    for key, (conc, reqs) in workloads.items():
        base = free_port()
        env = engine_env(conc, args)
        proc = start_triton(settings, repo, base, run_dir / f"triton-{key}.log", extra_env=env)
        rss = RssSampler(proc.pid)
        try:
            before = wait_quiet("the engine")
            results = run_triton(f"127.0.0.1:{base + 1}", reqs, conc)
            metrics_url = f"http://127.0.0.1:{base + 2}/metrics"
            time.sleep(0.5)
            s = summarize(results) | before
            s["peak_rss_mb"] = rss.stop() / 2**20
            s["kv_overhead_max"] = _metric(metrics_url, "fleet_engine_kv_overhead_max")
            s["preemptions"] = _metric(metrics_url, "fleet_engine_preemptions_total")
            # the engine's own TTFT (request added -> first token): what the client saw beyond it is transport
            ttft_sum, ttft_n = (_metric(metrics_url, f"fleet_engine_ttft_seconds_{x}") for x in ("sum", "count"))
            s["engine_ttft_mean_ms"] = ttft_sum / ttft_n * 1000 if ttft_sum is not None and ttft_n else None
            shared = [r for r, q in zip(results, reqs) if q.shared_prefix and not r.error]
            s["prefix_saved_shared"] = (sum(r.cached for r in shared) / max(1, sum(r.prompt for r in shared)))
            s["prefix_saved_all"] = s["cached_prompt_tokens"] / max(1, s["prompt_tokens"])
        finally:
            rss.stop()
            stop_pid(proc.pid)
        out[key] = s
        print(f"engine  {key}: {json.dumps(s)}", flush=True)
    return out


def bench_hf(weights: Path, workloads: dict, args) -> dict:
    out = {}
    for key, (conc, reqs) in workloads.items():
        tmp = RESULTS / f".hf-{os.getpid()}-{key}.json"
        before = wait_quiet("transformers")
        proc = subprocess.Popen([sys.executable, "-m", "bench.engine.bench_engine", "--hf-worker", str(weights),
                                 "--hf-batch", str(conc), "--hf-out", str(tmp), "--requests", str(len(reqs)),
                                 "--hf-workload", key.split("-")[0], "--burst-output", str(args.burst_output),
                                 "--rate", str(args.rate), "--seed", str(args.seed),
                                 "--dtype", hf_dtype(args.hf_dtype),
                                 "--threads", str(args.threads), "--output-max", str(args.output_max),
                                 "--prompt-max", str(args.prompt_max)],
                                cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        rss = RssSampler(proc.pid)
        proc.wait()
        peak = rss.stop()
        data = json.loads(tmp.read_text())
        tmp.unlink()
        s = summarize([Result(**d) for d in data]) | before
        s["peak_rss_mb"] = peak / 2**20
        out[key] = s
        print(f"hf      {key}: {json.dumps(s)}", flush=True)
    return out


def llama_cpu_flags() -> list[str]:
    """llama-server flags for this CPU. With AMX, a native build compiles ggml's AMX matmul backend, which
    segfaulted on its first matmul on a 2-core AMX Xeon VM (gdb: ggml_backend_amx_mul_mat); `--no-repack`
    keeps weights in ggml's plain layout, so Q4_1 runs its AVX-512 kernels (Q4_1 has no other repacked form)."""
    return ["--no-repack"] if "amx_int8" in cpu_flags() else []


def bench_llama(settings, workloads: dict, args) -> dict:
    from bench.engine.build_llama_server import build
    from build_engines.cpu import smollm2_gguf

    binary = build()
    out = {}
    for key, (conc, reqs) in workloads.items():
        port = free_port()
        log = open(settings.data_dir / f"llama-server-{key}.log", "w")
        proc = subprocess.Popen([str(binary), "-m", str(smollm2_gguf()), "--parallel", str(conc), "-c",
                                 str(conc * 1400), "--threads", str(args.threads), "--threads-batch", str(args.threads), "--port", str(port),
                                 "--host", "127.0.0.1", *llama_cpu_flags()],
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)   # its own process group: stop_pid kills the group
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {proc.returncode} while starting; see {log.name}")
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        rss = RssSampler(proc.pid)
        try:
            before = wait_quiet("llama-server")
            s = summarize(run_llama_server(url, reqs, conc)) | before
            s["peak_rss_mb"] = rss.stop() / 2**20
        finally:
            rss.stop()
            stop_pid(proc.pid)
        out[key] = s
        print(f"llama   {key}: {json.dumps(s)}", flush=True)
    return out


def write_doc(report: dict, command: str) -> None:
    replace_subsection("CPU", cpu_section(report, command))


def burst_engine_args(output_tokens: int, seed: int = 0) -> SimpleNamespace:
    """The engine settings and burst shape of the `fleet up` burst benchmarks (bench.engine.first_burst,
    bench.observability.tracing_ab): this script's defaults, `output_tokens` per stream."""
    return SimpleNamespace(kv_blocks=4096, step_tokens=256, threads=2, cpu_matmul="auto", cpu_kernels="auto",
                           stream_interval=0, burst_output=output_tokens, seed=seed)


def build_workload(kind: str, n: int, args) -> list[Request]:
    """The same request list in every process (the HF worker rebuilds it from the same arguments)."""
    if kind == "burst":
        return make_burst(n, args.seed, output_tokens=args.burst_output)
    return make_workload(n, args.rate, args.seed, output_range=(16, args.output_max),
                         prompt_range=(100, args.prompt_max))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="burst,poisson", help="burst, poisson or both (comma-separated)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 8, 1], help="Poisson levels")
    parser.add_argument("--burst-streams", type=int, default=32, help="requests (= concurrency) of the burst")
    parser.add_argument("--burst-output", type=int, default=128, help="output tokens per burst request")
    parser.add_argument("--requests", type=int, default=64, help="requests per Poisson level")
    parser.add_argument("--requests-c1", type=int, default=12, help="requests at concurrency 1 (slow)")
    parser.add_argument("--requests-per-level", default="", help="e.g. 32:64,8:32,1:8 (overrides the two above)")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="platform,engine,hf,llama",
                        help="platform (router + one replica via `fleet up`), engine (the replica alone), hf, llama")
    parser.add_argument("--dtype", default="bf16", help="our engine's weights (bf16 = the model as published)")
    parser.add_argument("--cpu-matmul", default="auto", choices=CPU_MATMULS,
                        help="our engine's CPU GEMM kind (engine setting cpu_matmul)")
    parser.add_argument("--cpu-kernels", default="auto", choices=("auto", "on", "off"),
                        help="our engine's fused CPU kernels (off: torch ops, for an A/B through the replica)")
    parser.add_argument("--hf-dtype", default="auto", choices=("auto", "bf16", "fp32"),
                        help="transformers' dtype; auto = bf16 where the CPU has bf16 units, else fp32")
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--step-tokens", type=int, default=256, help="engine max_num_batched_tokens")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads given to every system")
    parser.add_argument("--stream-interval", type=int, default=0,
                        help="our engine's tokens per streamed response under load (0 = the engine's default)")
    parser.add_argument("--output-max", type=int, default=256, help="longest output (smoke runs: smaller)")
    parser.add_argument("--prompt-max", type=int, default=1000, help="longest prompt (smoke runs: smaller)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every system at every level, taking turns; the median counts")
    parser.add_argument("--doc-from", type=Path, help="only re-render docs/benchmarks.md from a results JSON")
    parser.add_argument("--hf-worker", help=argparse.SUPPRESS)
    parser.add_argument("--hf-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-out", help=argparse.SUPPRESS)
    parser.add_argument("--hf-workload", default="poisson", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats})")
    if args.hf_worker:
        from dataclasses import asdict

        from bench.engine.peers import hf_worker
        reqs = build_workload(args.hf_workload, args.requests, args)
        results = hf_worker(args.hf_worker, reqs, args.hf_batch, args.dtype, args.threads)
        Path(args.hf_out).write_text(json.dumps([asdict(r) for r in results]))
        return
    if args.doc_from:
        report = json.loads(args.doc_from.read_text())
        write_doc(report, report.get("command", "python -m bench.engine.bench_engine"))
        return
    settings = load_settings()
    weights = smollm2_weights(settings.cache_dir)
    counts = {int(k): int(v) for k, v in (item.split(":") for item in args.requests_per_level.split(","))} \
        if args.requests_per_level else {}
    kinds = args.workloads.split(",")
    levels: dict[str, tuple[int, list[Request]]] = {}
    if "burst" in kinds:
        levels[f"burst-{args.burst_streams}"] = (args.burst_streams, build_workload("burst", args.burst_streams, args))
    if "poisson" in kinds:
        for c in args.concurrency:
            n = counts.get(c, args.requests_c1 if c == 1 else args.requests)
            levels[f"poisson-{c}"] = (c, build_workload("poisson", n, args))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    report = {"started": started, "load_avg": _load_avg(), "dtype": args.dtype,
              "cpu_matmul": cpu_matmul_kind(args.cpu_matmul, torch.bfloat16, torch.device("cpu"))
              if args.dtype == "bf16" else "", "cpu_kernels": args.cpu_kernels, "hf_dtype": hf_dtype(args.hf_dtype),
              "levels": list(levels), "requests": args.requests, "requests_c1": args.requests_c1,
              "rate": args.rate, "threads": args.threads, "repeats": args.repeats,
              "stream_interval": args.stream_interval or "default", "systems": {}}
    report["requests_per_level"] = {k: len(w) for k, (_, w) in levels.items()}
    systems = args.systems.split(",")
    runners = {"platform": lambda w: bench_platform(settings, w, args),
               "engine": lambda w: bench_engine(settings, weights, w, args), "hf": lambda w: bench_hf(weights, w, args),
               "llama": lambda w: bench_llama(settings, w, args)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report["path"] = str(path.relative_to(REPO_ROOT))
    command = "python -m bench.engine.bench_engine " + " ".join(sys.argv[1:])
    report["command"] = command.strip()
    # level by level, every system at one level before the next, written after each level: a long run
    # that is stopped early still leaves complete comparisons
    # With --repeats, the systems take turns (the order rotates each round) and each result is the median of
    # its runs (peers.combine_runs): a slow minute on a shared VM then falls on every system alike.
    for key, level in levels.items():
        runs: dict[str, list[dict]] = {system: [] for system in systems}
        for round_ in range(args.repeats):
            shift = round_ % len(systems)
            for system in systems[shift:] + systems[:shift]:
                # the previous system's replica may still be exiting; its cores must be free before the next
                wait_until(lambda: not tritonserver_running(), 60,
                           "no tritonserver left on this host (the benchmark runs alone: stop `make up` and other "
                           "benchmarks first)")
                runs[system].append(runners[system]({key: level})[key])
        for system in systems:
            report["systems"].setdefault(system, {})[key] = combine_runs(runs[system])
        path.write_text(json.dumps(report, indent=2))
        write_doc(report, command.strip())
    print(f"wrote {path} and docs/benchmarks.md")


if __name__ == "__main__":
    main()
