"""`fleet usage ...`: run the loader, report chargeback, manage prices and GPU-hours, export Parquet.

`register(subparsers)` adds the `usage` group to the fleet CLI. Every subcommand stores its handler as
`args.handler`, called as `handler(args, settings)` with a `common.settings.Settings`; it returns an exit
code. `python -m usage.cli usage ...` runs the same parser standalone.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from common.settings import Settings, load_settings
from usage import chargeback, retention, store
from usage import metrics_scraper
from usage.loader_cli import add_load_arguments, run_from_args

VIEWS = ("cost", "tokens", "gpu-hours", "top-callers", "rejects")

STORE_HELP = ("DuckDB control file; the lake (events, rollups, prices, GPU-hours) is FLEET_USAGE_LAKE_URI or "
              "<store>.lake beside it (default: %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:
    settings = load_settings()
    usage = subparsers.add_parser("usage", help="usage metering and chargeback",
                                  description="Usage metering: load events from Kafka into the store, "
                                              "report chargeback, set prices and GPU-hours.")
    sub = usage.add_subparsers(dest="usage_command", required=True, metavar="COMMAND")

    load = sub.add_parser("load", help="run the loader (Kafka -> usage lake), as `make up` does",
                          description="Consume usage events in a consumer group, validate, de-duplicate on "
                                      "request_id and write them and their hourly rollups to the lake, "
                                      "exactly once; offsets are committed after each write. Bad events go to the dead-letter topic. Stops on SIGTERM.")
    add_load_arguments(load, settings)
    load.set_defaults(handler=run_from_args)

    scrape = sub.add_parser("scrape-metrics", help="keep the router's Prometheus metrics over time, as `make up` does",
                            description="Scrape the router's /metrics every --interval seconds into the store's "
                                        "router_metrics table (the admin UI's Fleet history) and evaluate the "
                                        "armed automatic rollback rules once a minute. Stops on SIGTERM.")
    metrics_scraper.add_arguments(scrape, settings)
    scrape.set_defaults(handler=metrics_scraper.run_from_args)

    report = sub.add_parser("report", help="chargeback report (table, csv or json)",
                            description="Tokens, requests, errors, cost and GPU-hours from the usage store. "
                                        "Days are UTC; --since is inclusive, --until exclusive.",
                            epilog="example: fleet usage report --team search --since 2026-11-01 --format csv")
    report.add_argument("--view", choices=VIEWS, default="cost",
                        help="cost: tokens + priced cost per group; tokens: token counts per group; "
                             "gpu-hours: GPU-hours allocated per team; top-callers: highest-cost callers; "
                             "rejects: dead-lettered events per reason (default: %(default)s)")
    report.add_argument("--team", help="only this team")
    report.add_argument("--caller", help="only this caller (cost and tokens views)")
    report.add_argument("--model", help="only this model (cost and tokens views)")
    report.add_argument("--version", help="only this model version (cost and tokens views)")
    report.add_argument("--adapter", help="only this adapter, '' = base model (cost and tokens views)")
    report.add_argument("--tier", choices=("interactive", "standard", "batch"),
                        help="only this tier (cost and tokens views)")
    report.add_argument("--since", type=_date, help="first day, YYYY-MM-DD (default: 30 days ago)")
    report.add_argument("--until", type=_date, help="day after the last, YYYY-MM-DD (default: open)")
    report.add_argument("--by", default="team,model,adapter,tier",
                        help=f"comma-separated group-by dimensions from {','.join(chargeback.DIMENSIONS)} "
                             "(default: %(default)s)")
    report.add_argument("--by-day", action="store_true", help="gpu-hours view: one row per team and day")
    report.add_argument("--top", type=int, default=10, help="top-callers view: how many (default: %(default)s)")
    report.add_argument("--format", choices=("table", "csv", "json"), default="table", help="(default: %(default)s)")
    report.add_argument("--store", type=Path, default=settings.usage_db_path, help=STORE_HELP)
    report.set_defaults(handler=cmd_report)

    prices = sub.add_parser("prices", help="list or set per-model token prices",
                            description="Prices per 1M tokens, per model; model '*' is the fallback. "
                                        "Without --set, lists the prices.")
    prices.add_argument("--set", metavar="MODEL", help="model to set prices for ('*' = default)")
    prices.add_argument("--prefill", type=float, help="price per 1M uncached prompt tokens")
    prices.add_argument("--cached", type=float, help="price per 1M cached-prefix tokens (usually a discount)")
    prices.add_argument("--decode", type=float, help="price per 1M completion tokens")
    prices.add_argument("--format", choices=("table", "csv", "json"), default="table")
    prices.add_argument("--store", type=Path, default=settings.usage_db_path, help=STORE_HELP)
    prices.set_defaults(handler=cmd_prices)

    gpu = sub.add_parser("gpu-hours", help="record GPU-hours spent on a model version on a day",
                         description="Adds (or with --replace sets) the GPU-hours of one (day, model, version) in "
                                     "the lake's gpu_hours table; chargeback splits them over teams by token work.")
    gpu.add_argument("day", type=_date, help="YYYY-MM-DD (UTC)")
    gpu.add_argument("model")
    gpu.add_argument("version")
    gpu.add_argument("hours", type=float)
    gpu.add_argument("--replace", action="store_true", help="set instead of add")
    gpu.add_argument("--store", type=Path, default=settings.usage_db_path, help=STORE_HELP)
    gpu.set_defaults(handler=cmd_gpu_hours)

    maintain = sub.add_parser("maintain", help="retention and compaction of the usage lake (the loader also runs "
                              "it hourly)", description=retention.__doc__.split("\n\n")[1])
    maintain.add_argument("--raw-days", type=int, default=retention.RAW_RETENTION_DAYS,
                          help="keep raw events this many days (default: %(default)s)")
    maintain.add_argument("--rollup-days", type=int, default=retention.ROLLUP_RETENTION_DAYS,
                          help="keep hourly rollups this many days (default: %(default)s, 13 months)")
    maintain.add_argument("--compact-files", action=argparse.BooleanOptionalAction, default=True,
                          help="merge the small files loader batches leave (default: on)")
    maintain.add_argument("--store", type=Path, default=settings.usage_db_path,
                          help="DuckDB control file; the lake is FLEET_USAGE_LAKE_URI or <store>.lake (default: %(default)s)")
    maintain.set_defaults(handler=cmd_maintain)

    export = sub.add_parser("export", help="export the store to Parquet (partitioned by day)",
                            description="Writes usage_events as Parquet partitioned by day, plus prices and gpu_hours.")
    export.add_argument("--out", type=Path, default=settings.data_dir / "usage-parquet", help="(default: %(default)s)")
    export.add_argument("--store", type=Path, default=settings.usage_db_path, help=STORE_HELP)
    export.set_defaults(handler=cmd_export)


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {text!r}") from None


def cmd_report(args: argparse.Namespace, settings: Settings) -> int:
    since = args.since or (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=30))
    if args.view == "cost":
        by = [b.strip() for b in args.by.split(",") if b.strip()]
        df = chargeback.cost_table(args.store, since, args.until, group_by=by, team=args.team,
                                   caller=args.caller, model=args.model, filters=_filters(args))
    elif args.view == "tokens":
        by = [b.strip() for b in args.by.split(",") if b.strip()]
        df = chargeback.usage_summary(args.store, since, args.until, group_by=by, team=args.team,
                                      caller=args.caller, model=args.model, filters=_filters(args))
    elif args.view == "gpu-hours":
        df = chargeback.gpu_hours_by_team(args.store, since, args.until, team=args.team, by_day=args.by_day)
    elif args.view == "top-callers":
        df = chargeback.top_callers(args.store, since, args.until, n=args.top, team=args.team)
    else:
        df = chargeback.rejects_summary(args.store)
    title = f"usage {args.view} since {since}" + (f" until {args.until}" if args.until else "") + \
        (f", team {args.team}" if args.team else "")
    emit_frame(df, args.format, title)
    return 0


def _filters(args: argparse.Namespace) -> dict[str, str | None]:
    return {"version": args.version, "adapter": args.adapter, "tier": args.tier}


def cmd_prices(args: argparse.Namespace, settings: Settings) -> int:
    if args.set:
        current = store.list_prices(args.store).set_index("model")
        base = current.loc[args.set] if args.set in current.index else current.loc["*"]
        try:
            store.set_price(args.store, args.set,
                            base["prefill_per_m"] if args.prefill is None else args.prefill,
                            base["cached_per_m"] if args.cached is None else args.cached,
                            base["decode_per_m"] if args.decode is None else args.decode)
        except ValueError as exc:  # names the field and what is allowed
            Console(stderr=True).print(f"[red]price not set:[/red] {exc}")
            return 2
    emit_frame(store.list_prices(args.store), args.format, "prices per 1M tokens")
    return 0


def cmd_gpu_hours(args: argparse.Namespace, settings: Settings) -> int:
    store.add_gpu_hours(args.store, str(args.day), args.model, args.version, args.hours, replace=args.replace)
    Console(stderr=True).print(f"recorded {args.hours} GPU-hours for {args.model}:{args.version} on {args.day}")
    return 0


def cmd_maintain(args: argparse.Namespace, settings: Settings) -> int:
    for name, days in (("--raw-days", args.raw_days), ("--rollup-days", args.rollup_days)):
        if not 1 <= days <= 36600:
            raise SystemExit(f"{name}: {days} is out of range; allowed 1..36600 days")
    done = retention.maintain(store.lake_for(args.store), raw_days=args.raw_days, rollup_days=args.rollup_days,
                              compact_files=args.compact_files)
    print(json.dumps(done))
    return 0


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    files = store.export_parquet(args.store, args.out)
    Console().print(f"wrote {len(files)} Parquet files under {args.out}")
    return 0


def emit_frame(df: pd.DataFrame, fmt: str, title: str) -> None:
    """Print a DataFrame as a rich table, CSV or JSON records on stdout."""
    if fmt == "csv":
        df.to_csv(sys.stdout, index=False, float_format="%.6f")  # plain decimals, never 3e-06
    elif fmt == "json":
        out = df.copy()
        for col in out.columns:  # dates and timestamps as ISO strings
            if out[col].dtype == object or pd.api.types.is_datetime64_any_dtype(out[col]):
                out[col] = out[col].map(lambda v: v.isoformat() if hasattr(v, "isoformat") else v)
        print(json.dumps(out.to_dict(orient="records"), default=str))
    else:
        table = Table(title=title, show_lines=False)
        for col in df.columns:
            numeric = pd.api.types.is_numeric_dtype(df[col])
            table.add_column(col.replace("_tokens", "").replace("_per_m", "/1M"),
                             justify="right" if numeric else "left", no_wrap=True)
        for row in df.itertuples(index=False):
            table.add_row(*(_cell(v) for v in row))
        if df.empty:
            table.caption = "no usage in this range"
        # Piped output would otherwise be cut to 80 columns.
        console = Console()
        if not console.is_terminal:
            console = Console(width=240)
        console.print(table)


def _cell(value: object) -> str:
    if isinstance(value, float):
        text = f"{value:,.6f}" if abs(value) < 1000 else f"{value:,.2f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return f"{value:,}"
    if hasattr(value, "item"):  # numpy scalars
        return _cell(value.item())
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m usage.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args, load_settings())


if __name__ == "__main__":
    raise SystemExit(main())
