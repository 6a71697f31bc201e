"""Replica-choice policies on real replicas (two Triton replicas of SmolLM2 on this machine): the same
multi-turn workload with shared system prompts through the router, once per policy
(FLEET_ROUTER_POLICY = round_robin, least_loaded, prefix_hash, ours). Each policy run uses its own
system prompts so no run inherits another's prefix cache.

Usage: python bench/router/policies_real.py [--conversations 12] [--turns 3] [--concurrency 4]
Writes bench/results/router-policies-real.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tritonclient.grpc.aio as grpcaio  # noqa: E402

from tests.integration.router_client import stream_once  # noqa: E402
from tests.integration.router_stack import RouterStack  # noqa: E402

MODEL = "smollm2-135m"
TOPICS = ["a travel agency", "a bank's help desk", "a cooking school", "a bicycle shop"]
QUESTIONS = ["What do you offer?", "Why is that good?", "Give me one example.", "What else should I know?",
             "How do I start?", "Is it expensive?"]


def _system(salt: str, k: int) -> str:
    rules = " ".join(f"Rule {i}: be brief, polite and accurate about {TOPICS[k]}." for i in range(12))
    return f"<|im_start|>system\n[{salt}] You are the assistant of {TOPICS[k]}. {rules}<|im_end|>\n"


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _workload(stack: RouterStack, salt: str, args) -> dict:
    rng = random.Random(3)
    client = grpcaio.InferenceServerClient(stack.grpc_url)
    sem = asyncio.Semaphore(args.concurrency)
    ttfts, prompt_tokens, cached_tokens = [], 0, 0
    loads: dict[str, list[float]] = {}
    stop = asyncio.Event()

    async def sample_load():
        while not stop.is_set():
            for r in stack.fleet()["replicas"]:
                loads.setdefault(r["replica_id"], []).append(r.get("load_tokens") or 0)
            await asyncio.sleep(0.2)

    async def conversation(c: int):
        nonlocal prompt_tokens, cached_tokens
        history = _system(salt, c % len(TOPICS))
        async with sem:
            for t in range(args.turns):
                history += f"<|im_start|>user\n{rng.choice(QUESTIONS)}<|im_end|>\n<|im_start|>assistant\n"
                out = await stream_once(client, MODEL, history, args.max_tokens, stack.api_key, session=f"c{c}")
                if out.error is not None:
                    raise RuntimeError(out.error_message)
                ttfts.append(out.ttft_s * 1000)
                prompt_tokens += out.usage[0]
                cached_tokens += out.usage[1]
                history += out.text + "<|im_end|>\n"
    sampler = asyncio.create_task(sample_load())
    started = time.monotonic()
    await asyncio.gather(*[conversation(c) for c in range(args.conversations)])
    stop.set()
    await sampler
    await client.close()
    means = [statistics.mean(v) for v in loads.values() if v]
    return {"requests": len(ttfts), "seconds": round(time.monotonic() - started, 1),
            "prefix_hit_rate": round(cached_tokens / max(1, prompt_tokens), 4),
            "ttft_p50_ms": round(_pct(ttfts, 0.5), 1), "ttft_p95_ms": round(_pct(ttfts, 0.95), 1),
            "max_mean_load": round(max(means) / statistics.mean(means), 3) if means and statistics.mean(means) else None}


async def main_async(args) -> dict:
    stack = RouterStack.start(Path(tempfile.mkdtemp(prefix="bench-router-policies-")), replicas=args.replicas)
    runs = []
    try:
        for policy in ("round_robin", "least_loaded", "prefix_hash", "ours"):
            stack.restart_router({"FLEET_ROUTER_POLICY": policy})
            row = {"policy": policy, **await _workload(stack, f"{policy}-{time.time_ns()}", args)}
            print(json.dumps(row), flush=True)
            runs.append(row)
    finally:
        stack.stop()
    return {"replicas": args.replicas, "conversations": args.conversations, "turns": args.turns,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router-policies-real.json")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
