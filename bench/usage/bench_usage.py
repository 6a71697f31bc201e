"""Usage pipeline benchmark: producer cost on the request path, producer drain rate, loader throughput.

Runs against a fresh embedded tansu broker (or --bootstrap for any Kafka) and writes
bench/results/usage-throughput.json. Phases:
1. emit latency: an asyncio loop (like the router's) emits at --rate events/s for --seconds while the
   producer's sender thread ships them to the broker; p50/p99/p99.9 of `emit()` itself. Peer in the same
   run: kafka-python's own `send()` called on the request path instead (no spool).
2. producer drain: --events more are emitted as fast as possible, then flush(): spool -> Kafka events/s.
3. loader: `UsageLoader.run()` (the production loop: poll/validate of batch N+1 overlaps the lake write
   of batch N: events + rollups Delta commits) consumes everything into a fresh usage lake; events/s from the first stored batch on (so
   without the consumer-group join; the rate including it is reported too), and per CPU-second.
4. the same with `python -m usage.loader_cli --workers N` (N processes in the consumer group).
Targets (issue 5): emit p99 < 0.2 ms; loader >= 20,000 events/s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.processes import free_port, stop_pid  # noqa: E402
from common.services import start_tansu  # noqa: E402
from common.settings import load_settings  # noqa: E402
from usage import store  # noqa: E402
from usage.faultcheck import make_event  # noqa: E402
from usage.kafka_io import close_producer, make_producer  # noqa: E402
from usage.loader import UsageLoader  # noqa: E402
from usage.producer import UsageProducer  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def summary_ms(lat: list[float]) -> dict:
    return {"p50_ms": round(pct(lat, 0.5) * 1e3, 4), "p99_ms": round(pct(lat, 0.99) * 1e3, 4),
            "p999_ms": round(pct(lat, 0.999) * 1e3, 4), "max_ms": round(max(lat) * 1e3, 3)}


async def steady_emit(emit, rate: float, seconds: float, prefix: str = "lat") -> list[float]:
    """Call emit(event) at a steady rate from an event loop; returns its durations in seconds."""
    lat: list[float] = []
    n = int(rate * seconds)
    start = time.perf_counter()
    for i in range(n):
        ev = make_event(f"{prefix}-{i}", caller=f"caller-{i % 50}", team=f"team-{i % 5}")
        t0 = time.perf_counter()
        emit(ev)
        lat.append(time.perf_counter() - t0)
        ahead = start + (i + 1) / rate - time.perf_counter()
        if ahead > 0:
            await asyncio.sleep(ahead)
    return lat


def workers_run(bootstrap: str, topic: str, store_path: Path, workers: int, total: int) -> dict:
    """Load the whole topic again with a fresh group through the CLI loader with N worker processes;
    throughput counts from the first stored batch (after the group join) to the last row."""
    cmd = [sys.executable, "-m", "usage.loader_cli", "--bootstrap", bootstrap, "--store", str(store_path), "--topic",
           topic, "--dlq-topic", f"{topic}.dlq", "--group", f"g-{topic}-w", "--no-check-callers",
           "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    t_start = time.perf_counter()
    first = None
    rows = 0
    try:
        while time.perf_counter() - t_start < 600:
            with store.connect(store_path, read_only=True) as con:  # the lake; no control file needed
                rows = con.execute("SELECT count(*) FROM usage_events").fetchone()[0]
            if rows and first is None:
                first = (time.perf_counter(), rows)
            if rows >= total:
                break
            time.sleep(0.25)
        t_end = time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rate = round((rows - first[1]) / (t_end - first[0])) if first and t_end > first[0] else 0
    return {"workers": workers, "events": total, "rows": rows, "events_per_s": rate,
            "first_batch_after_s": round(first[0] - t_start, 2) if first else None,
            "load_average_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--bootstrap", help="use this Kafka instead of starting a tansu broker")
    parser.add_argument("--rate", type=float, default=3500.0,
                        help="emit rate of phase 1, events/s (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of phase 1 (default: %(default)s)")
    parser.add_argument("--events", type=int, default=200_000, help="events of phase 2 (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2,
                        help="phase 4: loader worker processes (0 or 1 = skip) (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "usage-throughput.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    settings = load_settings()
    work = Path(tempfile.mkdtemp(prefix="usage-bench-"))
    broker = None
    bootstrap = args.bootstrap
    if not bootstrap:
        port = free_port()
        broker = start_tansu(settings, port, work / "tansu.log")
        bootstrap = f"127.0.0.1:{port}"
    topic = f"usage-bench-{int(time.time())}"
    result: dict = {"bench": "usage-throughput", "host": platform.node(), "python": platform.python_version(),
                    "broker": "tansu (embedded, memory)" if broker else bootstrap, "started": time.time()}
    try:
        producer = UsageProducer(bootstrap, work / "spool", topic=topic).start()
        print(f"phase 1: emit latency at {args.rate:.0f}/s for {args.seconds:.0f} s ...", flush=True)
        lat = asyncio.run(steady_emit(producer.emit, args.rate, args.seconds))
        producer.flush(120)
        result["emit"] = {"events": len(lat), "rate_per_s": args.rate, **summary_ms(lat), "target_p99_ms": 0.2}
        print(json.dumps(result["emit"]), flush=True)
        # Peer: no spool, kafka-python's send() called on the request path (what the spool replaces).
        direct = make_producer(bootstrap, client_id="bench-direct")
        peer = asyncio.run(steady_emit(lambda ev: direct.send(f"{topic}-direct", key=ev.key(),
                                                              value=ev.to_json_bytes()), args.rate, args.seconds))
        direct.flush(60)
        close_producer(direct)
        result["emit_peer_direct_kafka_send"] = {"events": len(peer), "rate_per_s": args.rate, **summary_ms(peer)}
        print("peer, direct send():", json.dumps(result["emit_peer_direct_kafka_send"]), flush=True)

        print(f"phase 2: producer drain of {args.events} events ...", flush=True)
        events = [make_event(f"bulk-{i}", caller=f"caller-{i % 50}", team=f"team-{i % 5}") for i in range(args.events)]
        t0 = time.perf_counter()
        for ev in events:
            producer.emit(ev)
        t_emit = time.perf_counter() - t0
        ok = producer.flush(600)
        t_all = time.perf_counter() - t0
        producer.close()
        result["producer"] = {"events": args.events, "emit_s": round(t_emit, 3), "flushed": ok,
                              "spool_to_kafka_events_per_s": round(args.events / t_all)}
        print(json.dumps(result["producer"]), flush=True)

        total = len(lat) + args.events
        print(f"phase 3: loader, {total} events ...", flush=True)
        store_path = work / "usage.duckdb"
        loader = UsageLoader(bootstrap, store_path, topic=topic, group_id=f"g-{topic}", dlq_topic=f"{topic}.dlq")
        stop = threading.Event()
        runner = threading.Thread(target=loader.run, args=(stop,), daemon=True)  # the production loop
        t_start = time.perf_counter()
        cpu_start = time.process_time()
        runner.start()
        first = None  # (time, events) when the first batch was stored: the group is joined
        while loader.stats["consumed"] < total and time.perf_counter() - t_start < 600:
            if first is None and loader.stats["consumed"]:
                first = (time.perf_counter(), loader.stats["consumed"])
            time.sleep(0.02)
        t_end = time.perf_counter()
        cpu = time.process_time() - cpu_start
        stop.set()
        runner.join(timeout=60)
        with store.connect(store_path, read_only=True) as con:
            rows = con.execute("SELECT count(*) FROM usage_events").fetchone()[0]
        result["loader"] = {"events": total, "rows": rows, "batches": loader.stats["batches"],
                            "events_per_s": round((total - first[1]) / (t_end - first[0])) if first else 0,
                            "events_per_s_incl_group_join": round(total / (t_end - t_start)),
                            "first_batch_after_s": round(first[0] - t_start, 2) if first else None,
                            # CPU seconds of this process (all threads) per event: robust to other load
                            "events_per_cpu_s": round(total / cpu) if cpu else 0,
                            "phase_wall_s": {k: round(v, 2) for k, v in loader.timings.items()},
                            "load_average_1m": round(os.getloadavg()[0], 2), "target_events_per_s": 20000}
        print(json.dumps(result["loader"]), flush=True)
        if args.workers > 1:
            print(f"phase 4: `python -m usage.loader_cli --workers {args.workers}` (processes), same events ...",
                  flush=True)
            result["loader_workers"] = workers_run(bootstrap, topic, work / "usage-w.duckdb", args.workers, total)
            print(json.dumps(result["loader_workers"]), flush=True)
    finally:
        if broker:
            stop_pid(broker.pid)
        shutil.rmtree(work, ignore_errors=True)
    result["command"] = "python bench/usage/bench_usage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
