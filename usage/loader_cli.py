"""The usage loader's command line: `fleet usage load` and `python -m usage.loader_cli` (its arguments, the
registry's caller check, the metrics listener, extra worker processes in the consumer group, signals)."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

from common.logs import setup_logging
from usage import loader, loader_metrics, store
from usage.dedup import DEFAULT_WINDOW_S
from usage.loader import UsageLoader, registry_callers

log = logging.getLogger("usage.loader")


def main(argv: list[str] | None = None) -> int:
    from common.settings import load_settings
    settings = load_settings()
    parser = argparse.ArgumentParser(prog="python -m usage.loader_cli", description=(loader.__doc__ or "").split("\n\n")[0])
    add_load_arguments(parser, settings)
    args = parser.parse_args(argv)
    return run_from_args(args, settings)


def add_load_arguments(parser: argparse.ArgumentParser, settings) -> None:
    parser.add_argument("--bootstrap", default=settings.kafka_bootstrap,
                        help="Kafka bootstrap servers (default: KAFKA_BOOTSTRAP_SERVERS or %(default)s)")
    parser.add_argument("--store", type=Path, default=settings.usage_db_path,
                        help="DuckDB control file; the lake is FLEET_USAGE_LAKE_URI or <store>.lake beside it "
                             "(default: %(default)s)")
    parser.add_argument("--topic", default=settings.usage_topic, help="usage topic (default: %(default)s)")
    parser.add_argument("--dlq-topic", default=settings.usage_dlq_topic,
                        help="dead-letter topic (default: %(default)s)")
    parser.add_argument("--group", default="usage-loader", help="consumer group id (default: %(default)s)")
    parser.add_argument("--check-callers", action=argparse.BooleanOptionalAction, default=True,
                        help="reject events whose caller is not in the registry (default: on when the registry exists)")
    parser.add_argument("--batch-max", type=int, default=50_000, help="most events per batch (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="loader processes in the consumer group; each takes a share of the partitions and "
                             "writes as its own writer (<writer-id>-w<i>) (default: %(default)s)")
    parser.add_argument("--writer-id", default="", help="this loader's writer id in the lake's commits; must be "
                        "unique among loaders running at once and stable across restarts (default: the group id)")
    parser.add_argument("--dedup-window-s", type=float, default=DEFAULT_WINDOW_S,
                        help="seconds of loaded request_ids kept to drop repeats (default: %(default)s)")
    parser.add_argument("--maintain-every-s", type=float, default=3600.0,
                        help="run retention and rollup compaction this often, 0 = never (default: %(default)s)")
    parser.add_argument("--once", action="store_true", help="load one batch and exit (for scripts and tests)")


def run_from_args(args: argparse.Namespace, settings) -> int:
    setup_logging("usage-loader", settings.log_level, settings.log_format)  # kafka's INFO lines: off there
    known = None
    if args.check_callers and _registry_configured(settings):
        known = registry_callers(settings.db_url)
    if args.store.exists():
        with store.connect(args.store):  # moves a pre-lake control file's events into the lake, once
            pass
    loader = UsageLoader(args.bootstrap, args.store, topic=args.topic, group_id=args.group,
                         dlq_topic=args.dlq_topic, known_callers=known, batch_max=args.batch_max,
                         fault=settings.usage_fault, writer_id=args.writer_id,
                         dedup_window_s=args.dedup_window_s, maintain_every_s=args.maintain_every_s)
    if args.once:
        n = loader.run_once(max_wait_s=10.0)
        loader.close()
        print(json.dumps({"consumed": n, **loader.stats}))
        return 0
    if settings.usage_metrics_port:
        loader_metrics.serve(loader, settings.usage_metrics_host, settings.usage_metrics_port)
        loader.metrics_db_url = settings.db_url if _registry_configured(settings) else ""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children = [subprocess.Popen(_worker_argv(args, i)) for i in range(1, max(1, args.workers))]
    log.info("usage loader: %s -> %s (topic %s, group %s, caller check %s, %d worker(s))", args.bootstrap,
             args.store, args.topic, args.group, "on" if known else "off", 1 + len(children))
    try:
        loader.run(stop)
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)
    log.info("usage loader stopped: %s", loader.stats)
    return 0


def _worker_argv(args: argparse.Namespace, index: int) -> list[str]:
    """The command line of extra worker `index`: the same loader settings, a single process, its own writer id."""
    return [sys.executable, "-m", "usage.loader_cli", "--bootstrap", args.bootstrap, "--store", str(args.store),
            "--topic", args.topic, "--dlq-topic", args.dlq_topic, "--group", args.group,
            "--batch-max", str(args.batch_max), "--workers", "1",
            "--writer-id", f"{args.writer_id or args.group}-w{index}", "--dedup-window-s", str(args.dedup_window_s),
            "--maintain-every-s", "0",
            "--check-callers" if args.check_callers else "--no-check-callers"]


def _registry_configured(settings) -> bool:
    """A SQLite registry counts only if its file exists; any other URL (PostgreSQL) is assumed to be set up."""
    url = settings.db_url
    if url.startswith("sqlite:///"):
        return Path(url.removeprefix("sqlite:///")).exists()
    return True



if __name__ == "__main__":
    raise SystemExit(main())
