"""Router overhead: the same streaming load (50 concurrent streams) straight to a replica and through the
router, in one run, alternating rounds so both see the same machine noise; plus router CPU per 1,000
streamed tokens, and the engine costs that drive bench/router/simulate_policies.py.

Usage: python bench/router/overhead.py [--streams 50] [--rounds 4] [--max-tokens 32]
Writes bench/results/router-overhead.json and bench/results/router-engine-costs.json.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc.aio as grpcaio  # noqa: E402

from router_service.registry_cache import load_snapshot  # noqa: E402
from tests.integration.router_client import CHATML, stream_once  # noqa: E402
from tests.integration.router_stack import RouterStack  # noqa: E402

MODEL = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
             "What is 12 times 12?", "Who wrote Hamlet?", "What is the boiling point of water?",
             "Name a planet.", "What language is spoken in Brazil?", "What is H2O?", "Name a fruit."]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _mixed_round(replica_url: str, router_url: str, api_key: str, n: int, max_tokens: int, seed: int
                       ) -> tuple[list, list]:
    """n concurrent streams at once, half straight to the replica and half through the router, same prompts,
    submitted in shuffled order: both halves share the same engine steps and the same machine noise."""
    direct = grpcaio.InferenceServerClient(replica_url)
    routed = grpcaio.InferenceServerClient(router_url)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    try:
        def one(i: int):
            prompt = CHATML.format(q=QUESTIONS[(i // 2) % len(QUESTIONS)] + f" ({i // 2})")
            if i % 2 == 0:
                return stream_once(direct, "llm", prompt, max_tokens, "", request_id=f"d{seed}-{i}")
            return stream_once(routed, MODEL, prompt, max_tokens, api_key, request_id=f"r{seed}-{i}")
        results = await asyncio.gather(*[one(i) for i in order])
    finally:
        await direct.close()
        await routed.close()
    by_i = dict(zip(order, results))
    return [by_i[i] for i in range(0, n, 2)], [by_i[i] for i in range(1, n, 2)]


async def _sequential_pairs(replica_url: str, router_url: str, api_key: str, pairs: int) -> tuple[list, list]:
    """One stream at a time, alternating direct and routed: TTFT without batching noise."""
    direct = grpcaio.InferenceServerClient(replica_url)
    routed = grpcaio.InferenceServerClient(router_url)
    d, r = [], []
    try:
        for k in range(pairs):
            prompt = CHATML.format(q=QUESTIONS[k % len(QUESTIONS)])
            for mode in ("d", "r") if k % 2 == 0 else ("r", "d"):
                if mode == "d":
                    d.append(await stream_once(direct, "llm", prompt, 2, ""))
                else:
                    r.append(await stream_once(routed, MODEL, prompt, 2, api_key))
    finally:
        await direct.close()
        await routed.close()
    return d, r


async def _calibrate(url: str) -> dict:
    """Engine step costs straight from the replica: decode at batch 1 and 32, prefill per token."""
    client = grpcaio.InferenceServerClient(url)
    rng = random.Random(7)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]
    try:
        one = await stream_once(client, "llm", ids(16), 64, "")
        step1 = (one.duration_s - one.ttft_s) / max(1, len(one.ids) - 1)
        many = await asyncio.gather(*[stream_once(client, "llm", ids(16), 64, "") for _ in range(32)])
        step32 = statistics.median((r.duration_s - r.ttft_s) / max(1, len(r.ids) - 1) for r in many)
        short = [(await stream_once(client, "llm", ids(16), 1, "")).ttft_s for _ in range(3)]
        long = [(await stream_once(client, "llm", ids(1024), 1, "")).ttft_s for _ in range(3)]
    finally:
        await client.close()
    t_decode = max(0.0, (step32 - step1) / 31)
    return {"t0_s": round(max(0.001, step1 - t_decode), 5), "t_decode_s": round(t_decode, 6),
            "t_prefill_s": round(max(0.0, (min(long) - min(short)) / 1008), 7),
            "measured": {"step_batch1_s": round(step1, 4), "step_batch32_s": round(step32, 4),
                         "ttft_16_tokens_s": round(min(short), 4), "ttft_1024_tokens_s": round(min(long), 4)}}


def _stats(results: list) -> dict:
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s * 1000 for r in ok]
    return {"streams": len(results), "errors": len(results) - len(ok), "ttft_p50_ms": round(_pct(ttft, 0.5), 2),
            "ttft_p99_ms": round(_pct(ttft, 0.99), 2), "tokens": sum(len(r.ids) for r in ok)}


async def main_async(args) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    stack = RouterStack.start(data_dir, replicas=1)
    try:
        replica_url = load_snapshot(stack.settings.db_url).replicas[0].grpc_url
        costs = await _calibrate(replica_url)
        (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
        (ROOT / "bench" / "results" / "router-engine-costs.json").write_text(json.dumps(costs, indent=2) + "\n")
        print("engine costs", json.dumps(costs), flush=True)
        await _mixed_round(replica_url, stack.grpc_url, stack.api_key, args.streams, args.max_tokens, 0)  # warm-up
        seq_d, seq_r = await _sequential_pairs(replica_url, stack.grpc_url, stack.api_key, args.pairs)
        print("sequential", json.dumps(_stats(seq_d)), json.dumps(_stats(seq_r)), flush=True)
        direct, routed, cpu_s, routed_tokens, per_round = [], [], 0.0, 0, []
        for k in range(args.rounds):
            before = _cpu_s(stack.router.pid)
            d, r = await _mixed_round(replica_url, stack.grpc_url, stack.api_key, args.streams, args.max_tokens, k + 1)
            cpu_s += _cpu_s(stack.router.pid) - before
            routed_tokens += sum(len(x.ids) for x in r if x.error is None)
            direct += d
            routed += r
            sd, sr = _stats(d), _stats(r)
            per_round.append({"added_p50_ms": round(sr["ttft_p50_ms"] - sd["ttft_p50_ms"], 2),
                              "added_p99_ms": round(sr["ttft_p99_ms"] - sd["ttft_p99_ms"], 2),
                              "direct_p50_ms": sd["ttft_p50_ms"], "router_p50_ms": sr["ttft_p50_ms"]})
            print("round", k, json.dumps(_stats(d)), json.dumps(_stats(r)), flush=True)
        metrics = stack.metrics()
    finally:
        stack.stop()
    d, r = _stats(direct), _stats(routed)
    dispatch = [line for line in metrics.splitlines() if line.startswith("fleet_router_dispatch_seconds_")]
    sd, sr = _stats(seq_d), _stats(seq_r)
    return {"sequential_pairs": {"pairs": args.pairs, "direct": sd, "router": sr,
                                 "added_ttft_p50_ms": round(sr["ttft_p50_ms"] - sd["ttft_p50_ms"], 2),
                                 "added_ttft_p99_ms": round(sr["ttft_p99_ms"] - sd["ttft_p99_ms"], 2)},
            "concurrent_streams": args.streams, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "direct": d, "router": r, "per_round": per_round,
            "median_per_round_added_ttft_p50_ms": statistics.median(x["added_p50_ms"] for x in per_round),
            "median_per_round_added_ttft_p99_ms": statistics.median(x["added_p99_ms"] for x in per_round),
            "added_ttft_p50_ms": round(r["ttft_p50_ms"] - d["ttft_p50_ms"], 2),
            "added_ttft_p99_ms": round(r["ttft_p99_ms"] - d["ttft_p99_ms"], 2),
            "ttft_p50_ratio": round(r["ttft_p50_ms"] / d["ttft_p50_ms"], 3),
            "ttft_p99_ratio": round(r["ttft_p99_ms"] / d["ttft_p99_ms"], 3),
            "router_cpu_ms_per_1000_tokens": round(cpu_s * 1000 / max(1, routed_tokens) * 1000, 1),
            "router_dispatch_histogram": dispatch, "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=40, help="sequential direct/routed pairs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router-overhead.json")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "router_dispatch_histogram"}, indent=2))


if __name__ == "__main__":
    main()
