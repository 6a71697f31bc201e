"""Fair shares between teams across routers: how far the per-router approximation (each router's admission
queue keeps its own virtual clock, router_service/fair_queue.py) is from one queue for the whole tier.

A saturated replica pool (`slots` streams at once, each holding its slot for its tokens x `s_per_token`) is fed
by one admission queue per router, the real `AdmissionQueue`. Each request lands on a router at random (as
SO_REUSEPORT hashes new connections); `--a-on-first` skews team A's requests towards router 0 (0.5 = even).
A request that ends frees its slot and pumps its own router's queue (the other router finds the slot on its
periodic re-pump, admission.REPUMP_S, as a real router learns of another router's freed slot from the
replica's next report).

Two measures, the issue's (37) fairness criteria, for 1 router and for N:
- team A sends 10x team B's rate in one tier on a saturated pool: team B's TTFT p95 (queue wait + a 0.1 s
  prefill) with A present over B alone (target <= 1.5);
- both teams backlogged (B as fast as A): Jain index of their token service rates over the window both are
  served (target >= 0.9).

Usage: python -m bench.router.fair_share [--routers 1 2] [--runs 5] [--a-on-first 0.5] [--out PATH]
Prints one JSON line per (routers, run) and a summary; writes bench/results/router-fair-share.json.
Run alone (it measures waiting times on the event loop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from router_service.admission import AdmissionQueue
from router_service.fair_queue import FairShare

PREFILL_S = 0.1   # a ~2,000-token prompt's prefill on a GPU replica, added to queue wait for TTFT
TOKENS = 50       # mean tokens per request (prompt + max_tokens share); lengths vary 25..75


class Pool:
    """A saturated replica pool: `slots` streams at once, each holding its slot for tokens x `s_per_token`."""

    def __init__(self, slots: int, s_per_token: float) -> None:
        self.free, self.s_per_token = slots, s_per_token
        self.served: list[tuple[float, str, int]] = []   # (time, team, tokens)

    def placer(self):
        def try_place():
            if self.free <= 0:
                return None
            self.free -= 1
            return object()
        return try_place

    def release(self, _placement) -> None:
        self.free += 1


async def team(queues: list[AdmissionQueue], pool: Pool, name: str, every_s: float, n: int, waits: list[float],
               seed: int = 0, on_first: float | None = None) -> float:
    """`n` requests of team `name`, one every `every_s`, each on a router drawn at random (router 0 with
    probability `on_first`, default even); `waits` gets each one's queue wait. Returns when the last was sent."""
    rng = random.Random(f"{name}-{seed}")   # stream lengths vary, so slots free at random times

    async def one(q: AdmissionQueue):
        tokens = rng.randint(TOKENS // 2, TOKENS * 3 // 2)
        t = time.monotonic()
        placement = await q.admit("standard", None, pool.placer(), pool.release, name,
                                  share=FairShare(name, 1.0, tokens))
        waits.append(time.monotonic() - t)
        await asyncio.sleep(tokens * pool.s_per_token)
        pool.served.append((time.monotonic(), name, tokens))
        pool.release(placement)
        q.pump()
    first = 1 / len(queues) if on_first is None else on_first
    tasks = []
    for _ in range(n):
        i = 0 if rng.random() < first or len(queues) == 1 else rng.randrange(1, len(queues))
        tasks.append(asyncio.create_task(one(queues[i])))
        await asyncio.sleep(every_s)
    sent = time.monotonic()
    await asyncio.gather(*tasks)
    return sent


def p95(xs: list[float]) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


def ttft_ratio(routers: int, seed: int = 0, a_on_first: float | None = None) -> tuple[float, float]:
    """(B's TTFT p95 with A at 10x B's rate, B's TTFT p95 alone) through `routers` routers."""
    async def run(with_a: bool) -> list[float]:
        queues = [AdmissionQueue("m:1", 4096) for _ in range(routers)]
        pool, waits_b = Pool(slots=16, s_per_token=0.002), []
        jobs = [team(queues, pool, "b", 0.04, 25, waits_b, seed)]        # B: 25 req/s, below the pool's 160 req/s
        if with_a:
            jobs.append(team(queues, pool, "a", 0.004, 250, [], seed, a_on_first))  # A: 250 req/s, saturates it
        await asyncio.gather(*jobs)
        return [w + PREFILL_S for w in waits_b]
    return p95(asyncio.run(run(True))), p95(asyncio.run(run(False)))


def jain_backlogged(routers: int, seed: int = 0, a_on_first: float | None = None) -> tuple[float, list[int]]:
    """Jain index of two backlogged teams' token service rates while both keep sending (both send faster than
    the pool serves them, A at 4x B's rate): from the start until the first team's last request is sent.

    Not "until B's last request is served": after the teams stop sending, each router drains its own queue
    at the rate of the slots it happens to hold (a router refills the slots its own streams free before
    another router's reports show them), so a team's last requests finish on the slower router; that drain
    is an end effect of a finite burst, not the share of a sustained backlog."""
    async def run() -> tuple[Pool, float]:
        queues, pool = [AdmissionQueue("m:1", 4096) for _ in range(routers)], Pool(slots=4, s_per_token=0.0005)
        sent = await asyncio.gather(team(queues, pool, "a", 0.00125, 240, [], seed, a_on_first),
                                    team(queues, pool, "b", 0.005, 60, [], seed))
        return pool, min(sent)
    pool, end = asyncio.run(run())
    window = [(name, n) for t, name, n in pool.served if t <= end]
    rates = [sum(n for name, n in window if name == x) for x in ("a", "b")]
    return sum(rates) ** 2 / (2 * sum(r * r for r in rates)), rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", type=int, nargs="+", default=[1, 2], help="router counts to compare (1..8)")
    ap.add_argument("--runs", type=int, default=5, help="runs per router count (1..50)")
    ap.add_argument("--a-on-first", type=float, default=None,
                    help="share of team A's requests on router 0 (0..1; default: even over the routers)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" /
                    "router-fair-share.json")
    args = ap.parse_args()
    if not all(1 <= r <= 8 for r in args.routers) or not 1 <= args.runs <= 50:
        ap.error("--routers must be 1..8 each and --runs 1..50")
    if args.a_on_first is not None and not 0 <= args.a_on_first <= 1:
        ap.error(f"--a-on-first is {args.a_on_first}; allowed 0..1")
    rows = []
    for routers in args.routers:
        for run in range(args.runs):
            shared, alone = ttft_ratio(routers, run, args.a_on_first)
            jain, rates = jain_backlogged(routers, run, args.a_on_first)
            row = {"routers": routers, "run": run, "b_ttft_p95_s": round(shared, 4), "b_alone_ttft_p95_s":
                   round(alone, 4), "ttft_ratio": round(shared / alone, 3), "jain": round(jain, 4), "tokens": rates}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {str(r): {"ttft_ratio_max": max(x["ttft_ratio"] for x in rows if x["routers"] == r),
                        "ttft_ratio_median": statistics.median(x["ttft_ratio"] for x in rows if x["routers"] == r),
                        "jain_min": min(x["jain"] for x in rows if x["routers"] == r)} for r in args.routers}
    print(json.dumps({"summary": summary, "targets": {"ttft_ratio_max": 1.5, "jain_min": 0.9}}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"a_on_first": args.a_on_first, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
