"""Quota leases for a burst of requests: one transaction per request (the router before GroupCommit) vs the
router's QuotaLedger (the leases queued together written in one transaction, quotas.admit_many), same run,
same database, taking turns round by round.

Each round: `--requests` leases asked for at once on one event loop (one caller, as a burst from one service),
then all settled at once. Reports, per way and round, when the last lease was written and how long the settles
took (median over rounds), and the ratio.

Usage: python bench/router/quota_batching.py [--requests 32] [--rounds 7] [--db-url sqlite:///...]
Writes bench/results/router-quota-batching.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from registry import quotas  # noqa: E402
from registry.db import migrate, session_scope  # noqa: E402
from router_service.gateway import QuotaLedger, _today  # noqa: E402


class PerRequestLedger:
    """The peer: each lease and each settle its own transaction on a worker thread, as the router did before
    GroupCommit (taking turns inside the process on SQLite; on PostgreSQL concurrently, the caller's row lock
    ordering them)."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.turn = threading.Lock() if db_url.startswith("sqlite") else contextlib.nullcontext()

    def _admit(self, lease_id: str) -> None:
        with self.turn, session_scope(self.db_url) as s:
            quotas.admit(s, lease_id=lease_id, caller="bench", day=_today(), router_id="peer", tokens=100,
                         quota=10**12, max_concurrent=0)

    def _settle(self, lease_id: str) -> None:
        with self.turn, session_scope(self.db_url) as s:
            quotas.settle(s, lease_id, 50)

    async def reserve(self, lease_id: str) -> None:
        await asyncio.to_thread(self._admit, lease_id)

    async def settle(self, lease_id: str) -> None:
        await asyncio.to_thread(self._settle, lease_id)


class BatchedLedger:
    def __init__(self, db_url: str) -> None:
        self.ledger = QuotaLedger(db_url, "batched")

    async def reserve(self, lease_id: str) -> None:
        await self.ledger.reserve(lease_id, "bench", 10**12, 100, 0)

    async def settle(self, lease_id: str) -> None:
        await self.ledger.settle_off_loop(lease_id, 50)


async def one_round(ledger, tag: str, n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    await asyncio.gather(*(ledger.reserve(f"{tag}-{i}") for i in range(n)))
    admitted = time.perf_counter() - t0
    t1 = time.perf_counter()
    await asyncio.gather(*(ledger.settle(f"{tag}-{i}") for i in range(n)))
    return admitted * 1000, (time.perf_counter() - t1) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32, help="leases asked for at once per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per way (the first, warm-up, is not counted)")
    ap.add_argument("--db-url", default="", help="registry database (default: a new SQLite file)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router-quota-batching.json")
    args = ap.parse_args()
    db_url = args.db_url or f"sqlite:///{tempfile.mkdtemp(prefix='quota-bench-')}/registry.sqlite"
    migrate(db_url)
    ways = {"per_request": PerRequestLedger(db_url), "batched": BatchedLedger(db_url)}
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}

    async def run() -> None:
        for r in range(args.rounds + 1):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                result = await one_round(ways[name], f"{name}-{r}", args.requests)
                if r:
                    times[name].append(result)
    load_before = os.getloadavg()
    asyncio.run(run())
    report = {"requests": args.requests, "rounds": args.rounds, "db": db_url.split(":", 1)[0],
              "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()], "ways": {}}
    for name, rows in times.items():
        report["ways"][name] = {"last_admitted_ms_median": statistics.median(a for a, _ in rows),
                                "settle_all_ms_median": statistics.median(s for _, s in rows),
                                "rounds_ms": [[round(a, 2), round(s, 2)] for a, s in rows]}
    per, bat = report["ways"]["per_request"], report["ways"]["batched"]
    report["batched_over_per_request"] = {
        "last_admitted": bat["last_admitted_ms_median"] / per["last_admitted_ms_median"],
        "settle_all": bat["settle_all_ms_median"] / per["settle_all_ms_median"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
