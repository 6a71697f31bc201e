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

Fair shares across routers (router_service/fair_sync.py): `--sync memory` runs each router's FairSync over an
in-process table (the exchange without a database's latency), `--sync sqlite:///PATH` or a PostgreSQL URL over
the real `fair_heads` table (migrated here); `--sync off` (default) is each router on its own.

Usage: python -m bench.router.fair_share [--routers 1 2] [--runs 5] [--a-on-first 0.5] [--sync off|memory|URL]
                                          [--out PATH]
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

from collections.abc import Mapping

from router_service.admission import AdmissionQueue
from router_service.fair_queue import FairShare
from router_service import fair_sync
from router_service.fair_sync import FairSync, PeerRow, Snapshot, SqlFairStore

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


class MemoryFairStore:
    """The `fair_heads` table in memory, shared by the simulated routers of one process (bench only)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], tuple[int, Snapshot]] = {}

    def exchange(self, router_id: str, publish: Mapping[str, Snapshot], seq: int) -> list[PeerRow]:
        for queue, snap in publish.items():
            self.rows[(router_id, queue)] = (seq, snap)
        return [(r, q, n, snap) for (r, q), (n, snap) in self.rows.items() if r != router_id]


def start_syncs(queues: list[AdmissionQueue], sync: str | None) -> list[asyncio.Task]:
    """One FairSync per simulated router (none for `sync` None/'off' or one router)."""
    if sync in (None, "off") or len(queues) == 1:
        return []
    store = MemoryFairStore() if sync == "memory" else SqlFairStore(sync)
    syncs = [FairSync(store, f"router-{i}-{time.monotonic_ns()}", {q.name: q}, fair_sync.INTERVAL_S)
             for i, q in enumerate(queues)]
    for s in syncs:
        s.peer_seen_at = time.monotonic()   # routers that found each other (steady state, not the first 250 ms)
    return [asyncio.create_task(s.run_forever()) for s in syncs]


async def stop(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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


def ttft_ratio(routers: int, seed: int = 0, a_on_first: float | None = None,
               sync: str | None = None, b_on_first: float | None = None) -> tuple[float, float]:
    """(B's TTFT p95 with A at 10x B's rate, B's TTFT p95 alone) through `routers` routers."""
    async def run(with_a: bool) -> list[float]:
        queues = [AdmissionQueue("m:1", 4096) for _ in range(routers)]
        syncs = start_syncs(queues, sync)
        pool, waits_b = Pool(slots=16, s_per_token=0.002), []
        jobs = [team(queues, pool, "b", 0.04, 25, waits_b, seed, b_on_first)]  # B: 25 req/s, below the pool's 160
        if with_a:
            jobs.append(team(queues, pool, "a", 0.004, 250, [], seed, a_on_first))  # A: 250 req/s, saturates it
        await asyncio.gather(*jobs)
        await stop(syncs)
        return [w + PREFILL_S for w in waits_b]
    return p95(asyncio.run(run(True))), p95(asyncio.run(run(False)))


def jain_backlogged(routers: int, seed: int = 0, a_on_first: float | None = None, sync: str | None = None,
                    b_on_first: float | None = None) -> tuple[float, list[int], float]:
    """Jain index of two backlogged teams' token service rates while both keep sending (both send faster than
    the pool serves them, A at 4x B's rate): from the start until the first team's last request is sent.

    Not "until B's last request is served": after the teams stop sending, each router drains its own queue
    at the rate of the slots it happens to hold (a router refills the slots its own streams free before
    another router's reports show them), so a team's last requests finish on the slower router; that drain
    is an end effect of a finite burst, not the share of a sustained backlog.

    The third value: the share of the pool's slot time that served tokens in that window (a slot one router
    leaves to another's head stays free until that router's next pump)."""
    slots, s_per_token = 4, 0.0005

    async def run() -> tuple[Pool, float, float]:
        queues, pool = [AdmissionQueue("m:1", 4096) for _ in range(routers)], Pool(slots, s_per_token)
        syncs = start_syncs(queues, sync)
        start = time.monotonic()
        sent = await asyncio.gather(team(queues, pool, "a", 0.00125, 240, [], seed, a_on_first),
                                    team(queues, pool, "b", 0.005, 60, [], seed, b_on_first))
        await stop(syncs)
        return pool, start, min(sent)
    pool, start, end = asyncio.run(run())
    window = [(name, n) for t, name, n in pool.served if t <= end]
    rates = [sum(n for name, n in window if name == x) for x in ("a", "b")]
    busy = sum(rates) * s_per_token / (slots * (end - start))
    return sum(rates) ** 2 / (2 * sum(r * r for r in rates)), rates, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", type=int, nargs="+", default=[1, 2], help="router counts to compare (1..8)")
    ap.add_argument("--runs", type=int, default=5, help="runs per router count (1..50)")
    ap.add_argument("--a-on-first", type=float, default=None,
                    help="share of team A's requests on router 0 (0..1; default: even over the routers)")
    ap.add_argument("--b-on-first", type=float, default=None,
                    help="share of team B's requests on router 0 (0..1; default: even over the routers)")
    ap.add_argument("--sync", nargs="+", default=["off"],
                    help="fair shares across routers, each compared: off, memory, or a registry database URL")
    ap.add_argument("--interval-ms", type=float, default=fair_sync.INTERVAL_S * 1000,
                    help="FairSync exchange period in ms (5..1000)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" /
                    "router-fair-share.json")
    args = ap.parse_args()
    if not all(1 <= r <= 8 for r in args.routers) or not 1 <= args.runs <= 50:
        ap.error("--routers must be 1..8 each and --runs 1..50")
    for flag, value in (("--a-on-first", args.a_on_first), ("--b-on-first", args.b_on_first)):
        if value is not None and not 0 <= value <= 1:
            ap.error(f"{flag} is {value}; allowed 0..1")
    for sync in args.sync:
        if sync not in ("off", "memory") and not sync.startswith(("sqlite:///", "postgresql")):
            ap.error(f"--sync {sync!r}: allowed off, memory, sqlite:///PATH or a postgresql URL")
        if sync not in ("off", "memory"):
            from registry.db import migrate
            migrate(sync)
    if not 5 <= args.interval_ms <= 1000:
        ap.error(f"--interval-ms is {args.interval_ms}; allowed 5..1000")
    fair_sync.INTERVAL_S = args.interval_ms / 1000
    rows = []
    for sync in args.sync:
        for routers in args.routers:
            for run in range(args.runs):
                shared, alone = ttft_ratio(routers, run, args.a_on_first, sync, args.b_on_first)
                jain, rates, busy = jain_backlogged(routers, run, args.a_on_first, sync, args.b_on_first)
                row = {"sync": sync.split("@")[-1], "routers": routers, "run": run, "b_ttft_p95_s": round(shared, 4),
                       "b_alone_ttft_p95_s": round(alone, 4), "ttft_ratio": round(shared / alone, 3),
                       "jain": round(jain, 4), "tokens": rates, "pool_busy": round(busy, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {}
    for sync in {r["sync"] for r in rows}:
        for r in args.routers:
            mine = [x for x in rows if x["routers"] == r and x["sync"] == sync]
            summary[f"{sync} x{r}"] = {"ttft_ratio_max": max(x["ttft_ratio"] for x in mine),
                                       "ttft_ratio_median": statistics.median(x["ttft_ratio"] for x in mine),
                                       "jain_min": min(x["jain"] for x in mine),
                                       "pool_busy_median": statistics.median(x["pool_busy"] for x in mine)}
    print(json.dumps({"summary": summary, "targets": {"ttft_ratio_max": 1.5, "jain_min": 0.9}}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"a_on_first": args.a_on_first, "b_on_first": args.b_on_first, "rows": rows,
                                    "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
