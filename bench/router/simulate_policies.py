"""Replica-choice policies on a simulated fleet of 8-32 replicas, driven by engine costs measured on the
real CPU engine (bench/router/overhead.py writes bench/results/router-engine-costs.json).

Workload: shared system prompts (Zipf popularity) and multi-turn conversations: each turn's prompt is
the previous prompt + the previous answer + a new user message, so the previous prompt's blocks can
be served from the prefix cache of the replica that served the previous turn.

Replica model (the engine's, simplified): continuous batching; each step decodes one token for every
running sequence and prefills up to the step budget (256 tokens) of waiting prompts' uncached tokens;
step time = t0 + t_decode x running + t_prefill x prefill tokens. Each replica has an LRU prefix cache of
prompt blocks (hashed with the shared common.hashing function) of fixed capacity.

Router model: the policy sees what the real router sees: its own load view (tokens sent and not yet
streamed back), and cached prefixes from state reports every 200 ms plus the blocks it routed in the
last 5 s. "ours" is router_service.replica_choice.pick, the function the router runs.

Usage: python bench/router/simulate_policies.py [--replicas 8 16 32] [--seconds 120] [--out FILE]
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.hashing import prefix_block_hashes  # noqa: E402
from router_service.replica_choice import (ChoiceParams, ReplicaView, pick, pick_least_loaded,  # noqa: E402
                                           pick_prefix_hash)

BLOCK = 16
STEP_BUDGET = 256
MAX_RUNNING = 64
REPORT_S = 0.2
PENDING_TTL_S = 5.0
COSTS_FILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "router-engine-costs.json"
DEFAULT_COSTS = {"t0_s": 0.035, "t_decode_s": 0.0025, "t_prefill_s": 0.0007}


@dataclass
class Req:
    rid: int
    conv: "Conv"
    prompt: list[int]
    hashes: list[int]
    out_len: int
    arrival: float
    replica: int = -1
    uncached: int = 0
    prefilled: int = 0
    emitted: int = 0
    first_token: float | None = None
    cached_tokens: int = 0


@dataclass
class Conv:
    history: list[int]
    turns_left: int
    rng: random.Random  # the conversation's own randomness: every policy sees the same workload


@dataclass
class Replica:
    idx: int
    cache_blocks: int
    cache: OrderedDict = field(default_factory=OrderedDict)
    reported: set = field(default_factory=set)
    pending: dict = field(default_factory=dict)
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    busy: bool = False
    work: float = 0.0
    load_sum: float = 0.0  # running + queued tokens, summed over report ticks

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = True
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)


class Sim:
    def __init__(self, policy: str, n_replicas: int, seconds: float, conv_rate: float, costs: dict, seed: int,
                 cache_blocks: int = 2048) -> None:
        self.policy, self.seconds, self.costs = policy, seconds, costs
        self.rng = random.Random(seed)
        self.replicas = [Replica(i, cache_blocks) for i in range(n_replicas)]
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.rr = 0
        self.done: list[Req] = []
        self.rid = 0
        self.params = ChoiceParams()
        # shared system prompts, Zipf popularity
        self.systems = [[self.rng.randrange(1000, 40000) for _ in range(self.rng.randrange(256, 1025))]
                        for _ in range(12)]
        self.sys_weights = [1 / (k + 1) ** 1.1 for k in range(len(self.systems))]
        t = 0.0
        while t < seconds:
            t += self.rng.expovariate(conv_rate)
            crng = random.Random(self.rng.random())
            system = crng.choices(self.systems, self.sys_weights)[0]
            self.push(t, "conv", Conv(list(system), min(8, 1 + int(crng.expovariate(1 / 2.5))), crng))
        for k in range(int(seconds / REPORT_S) + 600):
            self.push(k * REPORT_S, "report", None)

    def push(self, t: float, kind: str, data) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    # --- workload ------------------------------------------------------------------------------------
    def new_turn(self, conv: Conv) -> None:
        user = [conv.rng.randrange(1000, 40000) for _ in range(conv.rng.randrange(16, 129))]
        prompt = conv.history + user
        self.rid += 1
        req = Req(self.rid, conv, prompt, prefix_block_hashes(prompt, BLOCK), conv.rng.randrange(32, 161), self.now)
        self.route(req)

    # --- router --------------------------------------------------------------------------------------
    def load(self, r: Replica) -> float:
        return sum(q.uncached - q.prefilled + q.out_len - q.emitted for q in r.waiting + r.running)

    def route(self, req: Req) -> None:
        n = len(self.replicas)
        if self.policy == "round_robin":
            i = self.rr % n
            self.rr += 1
        else:
            views = []
            for r in self.replicas:
                cut = self.now - PENDING_TTL_S
                k = 0
                for h in req.hashes:
                    if h in r.reported or r.pending.get(h, -1e9) >= cut:
                        k += 1
                    else:
                        break
                views.append(ReplicaView(str(r.idx), self.load(r), k))
            if self.policy == "least_loaded":
                i = pick_least_loaded(views)
            elif self.policy == "prefix_hash":
                i = pick_prefix_hash(views, req.hashes[0] if req.hashes else None)
            else:
                i = pick(views, len(req.prompt), BLOCK, len(req.prompt) + req.out_len, self.params,
                         req.hashes[0] if req.hashes else None)
        r = self.replicas[i]
        for h in req.hashes:
            r.pending[h] = self.now
        req.replica = i
        cached = r.cached_prefix(req.hashes)
        req.cached_tokens = min(len(req.prompt) - 1, cached * BLOCK)
        req.uncached = len(req.prompt) - req.cached_tokens
        r.insert(req.hashes[:cached])  # touch (LRU) the blocks it reuses
        r.waiting.append(req)
        if not r.busy:
            self.start_step(r)

    # --- replica -------------------------------------------------------------------------------------
    def start_step(self, r: Replica) -> None:
        while r.waiting and len(r.running) < MAX_RUNNING:
            r.running.append(r.waiting.pop(0))
        if not r.running:
            r.busy = False
            return
        decoding = [q for q in r.running if q.prefilled >= q.uncached]
        budget = max(0, STEP_BUDGET - len(decoding))
        plan = []
        for q in r.running:
            if q.prefilled < q.uncached and budget > 0:
                take = min(budget, q.uncached - q.prefilled)
                plan.append((q, take))
                budget -= take
        prefill_tokens = sum(t for _, t in plan)
        c = self.costs
        dt = c["t0_s"] + c["t_decode_s"] * len(decoding) + c["t_prefill_s"] * prefill_tokens
        r.busy = True
        r.work += len(decoding) + prefill_tokens
        self.push(self.now + dt, "step", (r.idx, decoding, plan))

    def finish_step(self, r: Replica, decoding: list[Req], plan: list) -> None:
        for q in decoding:
            q.emitted += 1
        for q, take in plan:
            q.prefilled += take
            if q.prefilled >= q.uncached:
                r.insert(q.hashes)
                q.first_token = self.now
                q.emitted += 1
        for q in [q for q in r.running if q.emitted >= q.out_len]:
            r.running.remove(q)
            self.done.append(q)
            conv = q.conv
            conv.history = q.prompt + [conv.rng.randrange(1000, 40000) for _ in range(q.out_len)]
            conv.turns_left -= 1
            if conv.turns_left > 0 and self.now < self.seconds:
                self.push(self.now + conv.rng.expovariate(1 / 3.0), "turn", conv)
        self.start_step(r)

    def run(self) -> dict:
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            self.now = t
            if kind in ("conv", "turn"):
                self.new_turn(data)
            elif kind == "step":
                idx, decoding, plan = data
                self.finish_step(self.replicas[idx], decoding, plan)
            elif kind == "report":
                for r in self.replicas:
                    r.reported = set(r.cache)
                    if self.now <= self.seconds:
                        r.load_sum += self.load(r)
                if self.now > self.seconds and not any(r.busy for r in self.replicas):
                    break
        return self.summary()

    def summary(self) -> dict:
        ttfts = sorted(q.first_token - q.arrival for q in self.done)
        prompt = sum(len(q.prompt) for q in self.done)
        cached = sum(q.cached_tokens for q in self.done)
        load = [r.load_sum for r in self.replicas]
        work = [r.work for r in self.replicas]
        return {"requests": len(self.done), "prefix_hit_rate": round(cached / prompt, 4),
                "ttft_p50_ms": round(1000 * ttfts[len(ttfts) // 2], 1),
                "ttft_p95_ms": round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))], 1),
                "max_mean_load": round(max(load) / statistics.mean(load), 3),
                "max_mean_work": round(max(work) / statistics.mean(work), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--conv-rate-per-replica", type=float, default=0.12,
                    help="new conversations per second per replica")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench/results/router-policies.json"))
    args = ap.parse_args()
    costs = json.loads(COSTS_FILE.read_text()) if COSTS_FILE.exists() else DEFAULT_COSTS
    results = {"costs": costs, "workload": {"seconds": args.seconds, "conv_rate_per_replica": args.conv_rate_per_replica,
                                            "system_prompts": 12, "seed": args.seed}, "runs": []}
    for n in args.replicas:
        for policy in ("round_robin", "least_loaded", "prefix_hash", "ours"):
            out = Sim(policy, n, args.seconds, args.conv_rate_per_replica * n, costs, args.seed).run()
            row = {"replicas": n, "policy": policy, **out}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
