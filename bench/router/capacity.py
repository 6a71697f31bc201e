"""Router capacity with a zero-cost replica (bench/router/standin: a real tritonserver whose Python model
answers the engine's contract instantly), so what is measured is the router alone: requests/s, streamed
tokens/s, router CPU seconds per request (2,000-token prompts, tokenised in the router) and per 1,000 streamed
tokens; one token per message and 16-token chunks; one router vs two routers sharing the port (SO_REUSEPORT).

CPU per request comes from runs of max_tokens=1, CPU per 1,000 tokens from the difference to runs of
`--max-tokens` (the same prompts), so the two costs are separated. CPU is read from /proc for every router
process. The load generator (tritonclient gRPC streams) and the stand-in run on the same machine: requests/s
and tokens/s are what this machine gave the router, CPU seconds per unit are the router's own cost.

Each (tokens per message, routers) case is measured `--rounds` times, 1 and 2 routers alternating within a
round (so drift in the machine's load hits both alike); the summary gives each case's median.

Usage: python -m bench.router.capacity [--requests 256] [--concurrency 16] [--max-tokens 128] [--rounds 3]
Writes bench/results/router-capacity.json. Run alone: CPU per request is what is compared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import tritonclient.grpc.aio as grpcaio  # noqa: E402

from common import processes  # noqa: E402
from common.processes import wait_until  # noqa: E402
from common.services import start_triton  # noqa: E402
from fleet.seed import DEFAULT_MODEL, DEFAULT_VERSION  # noqa: E402
from registry import queries  # noqa: E402
from registry.db import session_scope  # noqa: E402
from tests.integration.router_client import stream_once  # noqa: E402
from tests.integration.router_stack import RouterStack, _ok  # noqa: E402

STANDIN = ROOT / "bench" / "router" / "standin"
STANDIN_PORT = 8700
WORDS = ("river", "mountain", "ledger", "invoice", "shipment", "customer", "account", "balance", "forecast",
         "quarter", "region", "supplier", "contract", "warehouse", "delivery", "payment", "order", "market")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompt(i: int, words: int = 1900) -> str:
    """~2,000 SmolLM2 tokens of ordinary words, different per request (nothing cached on the way)."""
    rng = random.Random(i)
    return f"Request {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def start_standin(stack: RouterStack, chunk: int, data: Path) -> object:
    repo = data / f"standin-{chunk}"
    (repo / "engine" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "engine" / "config.pbtxt").write_text((STANDIN / "engine" / "config.pbtxt").read_text()
                                                  .replace("${chunk}", str(chunk)))
    (repo / "engine" / "1" / "model.py").write_text((STANDIN / "engine" / "1" / "model.py").read_text())
    proc = start_triton(stack.settings, repo, STANDIN_PORT, stack.settings.logs_dir / f"standin-{chunk}.log")
    with session_scope(stack.settings.db_url) as s:
        queries.upsert_replica(s, "standin", model=DEFAULT_MODEL, version=DEFAULT_VERSION, region=stack.settings.region,
                               grpc_url=f"127.0.0.1:{STANDIN_PORT + 1}", http_url=f"http://127.0.0.1:{STANDIN_PORT}",
                               state="serving", pid=proc.pid)
        queries.bump_version(s)
    return proc


async def run_load(url: str, api_key: str, n: int, concurrency: int, max_tokens: int, offset: int) -> dict:
    clients = [grpcaio.InferenceServerClient(url) for _ in range(16)]   # connections spread over the routers
    sem = asyncio.Semaphore(concurrency)
    tokens, errors = 0, []

    async def one(i: int) -> None:
        nonlocal tokens
        async with sem:
            r = await stream_once(clients[i % len(clients)], DEFAULT_MODEL, prompt(offset + i), max_tokens, api_key,
                                  request_id=f"cap-{offset + i}")
            if r.error:
                errors.append(r.error_message)
            tokens += len(r.ids)
    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - started
    for c in clients:
        await c.close()
    return {"requests": n, "tokens": tokens, "wall_s": wall, "errors": errors[:3], "error_count": len(errors)}


def measure(stack: RouterStack, pids: list[int], n: int, concurrency: int, max_tokens: int, offset: int) -> dict:
    before = sum(_cpu_s(p) for p in pids)
    out = asyncio.run(run_load(stack.grpc_url, stack.api_key, n, concurrency, max_tokens, offset))
    out["router_cpu_s"] = sum(_cpu_s(p) for p in pids) - before
    out["requests_per_s"] = out["requests"] / out["wall_s"]
    out["tokens_per_s"] = out["tokens"] / out["wall_s"]
    return out


def served(url: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith("fleet_router_requests_total{"))


def scenario(stack: RouterStack, pids: list[int], args, offset: int) -> dict:
    # warm-up until every router served requests (its tokenizer loaded, its channel to the stand-in open)
    urls = stack.settings.router_internal_urls[:len(pids)]
    for i in range(20):
        measure(stack, pids, 16, 8, 4, offset + 900_000 + 100 * i)
        if all(served(u) >= 4 for u in urls):
            break
    short = measure(stack, pids, args.requests, args.concurrency, 1, offset)
    long = measure(stack, pids, args.requests, args.concurrency, args.max_tokens, offset + 100_000)
    per_req = short["router_cpu_s"] / short["requests"]
    extra_tokens = long["tokens"] / long["requests"] - short["tokens"] / short["requests"]
    per_1k = (long["router_cpu_s"] / long["requests"] - per_req) / extra_tokens * 1000 if extra_tokens > 0 else None
    return {"short": short, "long": long, "cpu_s_per_request": per_req, "cpu_s_per_1k_tokens": per_1k}


def _bounded(lo: int, hi: int):
    def parse(text: str) -> int:
        value = int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value
    return parse


def summarise(runs: list[dict]) -> list[dict]:
    """Per (tokens per message, routers): medians over the rounds, and 2 routers' CPU over 1 router's."""
    out = []
    for chunk in sorted({r["tokens_per_message"] for r in runs}):
        for routers in (1, 2):
            rs = [r for r in runs if r["tokens_per_message"] == chunk and r["routers"] == routers]
            if not rs:
                continue
            per_1k = [r["cpu_s_per_1k_tokens"] for r in rs if r["cpu_s_per_1k_tokens"] is not None]
            out.append({"tokens_per_message": chunk, "routers": routers, "rounds": len(rs),
                        "cpu_ms_per_request": 1000 * statistics.median(r["cpu_s_per_request"] for r in rs),
                        "cpu_s_per_1k_tokens": statistics.median(per_1k) if per_1k else None,
                        "requests_per_s": statistics.median(r["short"]["requests_per_s"] for r in rs),
                        "tokens_per_s": statistics.median(r["long"]["tokens_per_s"] for r in rs),
                        "errors": sum(r["short"]["error_count"] + r["long"]["error_count"] for r in rs)})
    for row in out:
        one = next((o for o in out if o["tokens_per_message"] == row["tokens_per_message"] and o["routers"] == 1), None)
        if row["routers"] == 2 and one is not None:
            row["cpu_per_request_vs_1_router"] = row["cpu_ms_per_request"] / one["cpu_ms_per_request"]
            if row["cpu_s_per_1k_tokens"] and one["cpu_s_per_1k_tokens"]:
                row["cpu_per_token_vs_1_router"] = row["cpu_s_per_1k_tokens"] / one["cpu_s_per_1k_tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=_bounded(16, 100_000), default=256,
                    help="requests per measurement (16..100000; default 256)")
    ap.add_argument("--concurrency", type=_bounded(1, 1024), default=16,
                    help="streams in flight at once (1..1024; default 16)")
    ap.add_argument("--max-tokens", type=_bounded(2, 4096), default=128,
                    help="tokens per request of the streaming runs (2..4096; default 128); the per-request runs "
                         "use max_tokens 1")
    ap.add_argument("--rounds", type=_bounded(1, 10), default=3,
                    help="rounds per case, 1 and 2 routers alternating (1..10; default 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router-capacity.json",
                    help="where the JSON goes (default bench/results/router-capacity.json)")
    args = ap.parse_args()
    results: dict = {"load_average_before": os.getloadavg(), "args": vars(args) | {"out": str(args.out)}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="router-capacity-") as tmp:
        data = Path(tmp)
        stack = RouterStack.start(data, replicas=0, router_env={
            "FLEET_ROUTERS": "2", "FLEET_ROUTER_RATE_LIMIT_RPS": "100000", "FLEET_ROUTER_RATE_LIMIT_BURST": "100000"})
        second = None
        try:
            for chunk in (1, 16):
                standin = start_standin(stack, chunk, data)
                wait_until(lambda: asyncio.run(run_load(stack.grpc_url, stack.api_key, 1, 1, 2, 0))["error_count"] == 0,
                           30, "the router to route to the stand-in")
                for routers in [r for _ in range(args.rounds) for r in (1, 2)]:
                    if routers == 2 and second is None:
                        second = processes.spawn([sys.executable, "-m", "router_service", "--no-usage", "--index", "1"],
                                                 stack.settings.logs_dir / "router-1.log", env=stack.env, cwd=ROOT)
                        wait_until(lambda: _ok(f"{stack.settings.router_internal_urls[1]}/metrics"), 60, "router 1")
                        time.sleep(1.5)   # its registry snapshot has the stand-in
                    if routers == 1 and second is not None:
                        processes.stop_pid(second.pid)
                        second = None
                    pids = [stack.router.pid] + ([second.pid] if second is not None else [])
                    offset = chunk * 10_000_000 + len(results["runs"]) * 1_000_000   # new prompts every run
                    run = scenario(stack, pids, args, offset=offset)
                    run |= {"tokens_per_message": chunk, "routers": routers, "load_average": os.getloadavg()}
                    results["runs"].append(run)
                    print(json.dumps({k: run[k] for k in ("tokens_per_message", "routers", "cpu_s_per_request",
                                                          "cpu_s_per_1k_tokens", "load_average")}), flush=True)
                    print(f"  short: {run['short']['requests_per_s']:.1f} req/s, long: "
                          f"{run['long']['tokens_per_s']:.0f} tok/s, errors {run['short']['error_count']}+"
                          f"{run['long']['error_count']}", flush=True)
                processes.stop_pid(standin.pid)
                if second is not None:
                    processes.stop_pid(second.pid)
                    second = None
        finally:
            if second is not None:
                processes.stop_pid(second.pid)
            stack.stop()
    results["load_average_after"] = os.getloadavg()
    results["summary"] = summarise(results["runs"])
    for row in results["summary"]:
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
