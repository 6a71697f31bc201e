"""Retention and compaction of the usage lake (run by the loader once an hour, or `fleet usage maintain`).

- Retention: raw events older than `raw_days` (default 35: a month of disputes plus slack) and rollups older
  than `rollup_days` (default 397: 13 months, so a year-over-year month is always whole) are deleted. Day
  partitions are dropped whole, so this is a log-only commit.
- Rollup compaction: every closed day (before today, UTC) whose rollups are spread over several files (one
  per loader batch) is rewritten as one file with one row per (hour, dimensions), atomically replacing the
  partition (Delta overwrite with a `day = ...` predicate). A late event appended meanwhile makes the commit
  conflict; it fails and the next run retries.
- File compaction: each loader batch adds one small file per day to `events` and to `rollups_hourly`
  (~86,000 a day at one batch a second), and every reader opens the table's file list; so small files are
  merged (delta-rs `optimize.compact`, which only rewrites files below its target size, so each run
  rewrites roughly the last interval's files) in every partition, today's included: a compaction commit
  only removes the files it rewrote, so it does not conflict with the loader's blind appends.
- Vacuum: files no longer referenced and older than `vacuum_hours` (default 168) are removed, so a reader
  holding an old snapshot for up to that long still finds its files.
"""
from __future__ import annotations

import datetime as dt
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake

from usage import rollups
from usage.lake import EVENTS, ROLLUPS, ROLLUPS_SCHEMA, Lake, open_table
from usage.price_tables import GPU_HOURS, PRICES

RAW_RETENTION_DAYS = 35
ROLLUP_RETENTION_DAYS = 397


def _files_per_day(table) -> Counter:
    actions = pa.table(table.get_add_actions(flatten=True))  # arro3 -> pyarrow (Arrow C stream, no copy)
    if "partition.day" not in actions.column_names:
        return Counter()
    return Counter(str(d) for d in actions.column("partition.day").to_pylist())


def maintain(lake: Lake, today: dt.date | None = None, raw_days: int = RAW_RETENTION_DAYS,
             rollup_days: int = ROLLUP_RETENTION_DAYS, compact_files: bool = True,
             vacuum_hours: int = 168) -> dict:
    """One maintenance pass; returns what it did (for the log and the CLI)."""
    today = today or dt.datetime.now(dt.UTC).date()
    done: dict = {"expired_event_days_before": str(today - dt.timedelta(days=raw_days)),
                  "expired_rollup_days_before": str(today - dt.timedelta(days=rollup_days))}
    events = open_table(lake, EVENTS)
    if events is not None:
        events.delete(f"day < '{today - dt.timedelta(days=raw_days)}'")
        if compact_files:
            days = sorted(d for d, n in _files_per_day(events).items() if n > 1)
            for day in days:
                events.optimize.compact(partition_filters=[("day", "=", day)])
            done["compacted_event_days"] = len(days)
        events.vacuum(retention_hours=vacuum_hours, enforce_retention_duration=False, dry_run=False)
    table = open_table(lake, ROLLUPS)
    if table is not None:
        table.delete(f"day < '{today - dt.timedelta(days=rollup_days)}'")
        days = sorted(d for d, n in _files_per_day(table).items() if n > 1 and d < str(today))
        for day in days:
            merged = rollups.merge(table.to_pyarrow_dataset().to_table(
                filter=_day_filter(day)))
            write_deltalake(table.table_uri, merged.cast(ROLLUPS_SCHEMA), mode="overwrite",
                            predicate=f"day = '{day}'", partition_by=["day"],
                            storage_options=lake.storage_options or None)
            table.update_incremental()
        done["compacted_rollup_days"] = len(days)
        if compact_files and _files_per_day(table).get(str(today), 0) > 1:
            table.optimize.compact(partition_filters=[("day", "=", str(today))])  # partial rows stay partial
        table.vacuum(retention_hours=vacuum_hours, enforce_retention_duration=False, dry_run=False)
    for name in (PRICES, GPU_HOURS):  # small tables that every edit (a MERGE) rewrites: drop the old files
        small = open_table(lake, name)
        if small is not None:
            if compact_files:
                small.optimize.compact()
            small.vacuum(retention_hours=vacuum_hours, enforce_retention_duration=False, dry_run=False)
    return done


def _day_filter(day: str) -> pc.Expression:
    return pc.field("day") == dt.date.fromisoformat(day)
