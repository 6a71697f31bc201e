"""The usage store: Delta tables for the events, their rollups, prices and GPU-hours (usage/lake.py,
usage/price_tables.py), plus a small DuckDB control file for the router_metrics history of
usage/fleet_metrics.py (written and read where the metrics scraper runs).

`connect()` opens the control file and registers the lake's tables on the same DuckDB connection, so every
reader queries one namespace:
- `usage_events`: the `UsageEvent` columns (docs/architecture.md, Usage events) + `day` (UTC date of `ts`)
  + the loader's bookkeeping (`load_writer`, `load_seq`, `loaded_at`); partitioned by day, no primary key
  (the loader de-duplicates, see usage/loader.py).
- `usage_rollups`: hourly partial aggregates (usage/rollups.py); chargeback and the forecaster read these.
- `usage_rejects`: events the loader refused (schema, negative tokens, unknown caller), with the reason.
- `prices`: per-model prices in currency units per 1M tokens for prefill, cached-prefix and decode tokens;
  model '*' is the fallback for models without their own row (operator rows in the lake, else defaults).
- `gpu_hours`: GPU-hours the fleet spent per (day, model, version), written by whoever runs replicas
  (the autoscaler / `fleet usage gpu-hours`); chargeback allocates them to teams.

Locking: the lake never locks readers out (each query reads one committed snapshot). The control file is
DuckDB's one-writer-or-many-readers file, now written only by the metrics scraper, so nobody keeps it
open: writers and readers open it per call and retry while the other holds it.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from usage import price_tables, rollups
from usage.lake import (EVENT_FIELDS, EVENTS, EVENTS_SCHEMA, OPTIONAL_EVENT_FIELDS, REJECTS, REJECTS_SCHEMA, ROLLUPS,
                        Lake, append, lake_for, register_views, txn_version)

EVENT_COLUMNS = [name for name, _ in EVENT_FIELDS]  # what every event row gives
LOADED_COLUMNS = EVENT_COLUMNS + [name for name, _ in OPTIONAL_EVENT_FIELDS]  # + the nullable ones, in order

log = logging.getLogger(__name__)

DEFAULT_PRICES = price_tables.DEFAULT_PRICES  # where the budgets' price book starts

LOCK_RETRY_S = 30.0


def _is_lock_error(exc: Exception) -> bool:
    # Another process holds the file lock, or (same process) a connection with another read_only mode.
    text = str(exc).lower()
    return "lock" in text or "different configuration" in text


@contextmanager
def connect(store_path: Path, read_only: bool = False, timeout_s: float = LOCK_RETRY_S,
            lake: Lake | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the control file briefly (creating it with the schema on first use), retrying while another
    process holds it, with the lake's tables registered (`lake`: default `lake_for(store_path)`)."""
    store_path = Path(store_path)
    lake = lake or lake_for(store_path)
    if read_only and not store_path.exists():
        # A reader on a node without the control file (admin UI, autoscaler in deploy/): the lake's tables
        # plus the default prices in memory.
        con = duckdb.connect()
        try:
            _register(con, lake)
            _lakes[id(con)] = lake
            yield con
        finally:
            _lakes.pop(id(con), None)
            con.close()
        return
    store_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            con = duckdb.connect(str(store_path), read_only=read_only)
            break
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            if not _is_lock_error(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.05)  # short: the holder is usually a ~0.1-1 s batch or query
    _lakes[id(con)] = lake
    try:
        if not read_only:
            _import_legacy(con, lake)
        _register(con, lake)
        yield con
    finally:
        _lakes.pop(id(con), None)
        con.close()


_lakes: dict[int, Lake] = {}  # open connection -> its lake, for insert_events / insert_rejects


def lake_of(con: duckdb.DuckDBPyConnection) -> Lake:
    """The lake of a connection opened by `connect()`."""
    return _lakes[id(con)]


def _register(con: duckdb.DuckDBPyConnection, lake: Lake) -> None:
    """Every usage table on the connection: events, rollups, rejects, prices, gpu_hours (all in the lake)."""
    register_views(con, lake)
    price_tables.register(con, lake)


LEGACY_CHUNK = 1_000_000


def _import_legacy(con: duckdb.DuckDBPyConnection, lake: Lake) -> None:
    """A control file from before the lake holds `usage_events` / `usage_rejects` tables (which the lake's
    views would hide): move their rows into the lake once, then drop them. Each chunk is one commit carrying
    the application transaction ("legacy-import:<table>", chunk), so a crash mid-way resumes without repeats."""
    legacy = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE NOT temporary AND table_name "
                                        "IN ('usage_events', 'usage_rejects', 'prices', 'gpu_hours')").fetchall()}
    for name in ("prices", "gpu_hours"):  # before the lake held them (prices set on one box only)
        if name in legacy:
            rows = con.execute(f"SELECT * FROM {name}").to_arrow_table()
            if name == "prices":  # the old column was a naive UTC TIMESTAMP
                rows = rows.set_column(4, "updated_at", rows["updated_at"].cast(pa.timestamp("us", tz="UTC")))
            price_tables.import_rows(lake, name, rows)
            con.execute(f"DROP TABLE {name}")
            log.warning("usage store: moved %d rows of %s from the control file into the lake %s",
                        rows.num_rows, name, lake.uri)
    for name, table in (("usage_events", EVENTS), ("usage_rejects", REJECTS)):
        if name not in legacy:
            continue
        app = f"legacy-import:{name}"
        done = txn_version(lake, table, app)
        rolled = txn_version(lake, ROLLUPS, app) if table == EVENTS else done
        total = con.execute(f"SELECT count(*) FROM {name}").fetchall()[0][0]
        key = "request_id" if name == "usage_events" else "id"
        for chunk in range(min(done, rolled) + 1, (total + LEGACY_CHUNK - 1) // LEGACY_CHUNK):
            frame = con.execute(f"SELECT * FROM {name} ORDER BY {key} LIMIT {LEGACY_CHUNK} "
                                f"OFFSET {chunk * LEGACY_CHUNK}").df()
            if name == "usage_events":
                rows = events_table(frame, writer="legacy", seq=chunk)
                if chunk > done:
                    append(lake, EVENTS, rows, txn=(app, chunk))
                append(lake, ROLLUPS, rollups.rollup(rows), txn=(app, chunk))  # chunk > rolled here
            else:
                rows = rejects_table(list(frame[["id", "reason", "raw"]].itertuples(index=False)), "legacy", chunk)
                append(lake, REJECTS, rows, txn=(app, chunk))
        con.execute(f"DROP TABLE {name}")
        log.warning("usage store: moved %d rows of the legacy table %s into the lake %s", total, name, lake.uri)


def events_table(rows_or_frame, writer: str = "direct", seq: int = 0, loaded_at: float | None = None) -> pa.Table:
    """Event rows (tuples in EVENT_COLUMNS order, or a DataFrame with those columns) as an Arrow table of the
    lake's events schema. Raises pyarrow.ArrowInvalid / ValueError for a value the store cannot hold
    (e.g. a ts whose day is past year 9999)."""
    fields = EVENT_FIELDS + OPTIONAL_EVENT_FIELDS
    if isinstance(rows_or_frame, pd.DataFrame):
        # an optional column missing from the frame (or NaN in it) is null
        frame = rows_or_frame
        cols = {c: pa.array([None if v is None or v != v else v for v in frame[c].tolist()] if c in frame
                            else [None] * len(frame), type=t) if (c, t) in OPTIONAL_EVENT_FIELDS
                else pa.array(frame[c].tolist(), type=t) for c, t in fields}
    else:
        # tuples in LOADED_COLUMNS order; shorter ones (EVENT_COLUMNS only) leave the optional columns null
        columns = list(zip(*rows_or_frame)) if rows_or_frame else []
        cols = {c: pa.array(list(columns[i]) if i < len(columns) else [None] * len(rows_or_frame), type=t)
                for i, (c, t) in enumerate(fields)}
    n = len(cols["ts"])
    # day = UTC date of ts; the cast refuses (ArrowInvalid) a ts whose milliseconds overflow int64.
    ms = pc.cast(pc.floor(pc.multiply(cols["ts"], 1000.0)), pa.int64())
    cols["day"] = pc.cast(pc.cast(ms, pa.timestamp("ms")), pa.date32())
    cols["load_writer"] = pa.array([writer] * n, pa.string())
    cols["load_seq"] = pa.array([seq] * n, pa.int64())
    cols["loaded_at"] = pa.array([time.time() if loaded_at is None else loaded_at] * n, pa.float64())
    return pa.table(cols, schema=EVENTS_SCHEMA)


def insert_events(con: duckdb.DuckDBPyConnection, frame: pd.DataFrame) -> int:
    """Append events (columns = EVENT_COLUMNS) and their rollups to the connection's lake, skipping
    request_ids already stored on the same days. For tools and tests; the loader writes through
    usage/loader.py's exactly-once path. Returns the number of new rows."""
    if frame.empty:
        return 0
    lake = lake_of(con)
    table = events_table(frame.drop_duplicates("request_id"))
    con.register("incoming", table)
    try:
        days = [d[0] for d in con.execute("SELECT DISTINCT day FROM incoming").fetchall()]
        known = {r[0] for r in con.execute(
            "SELECT request_id FROM usage_events WHERE day IN (SELECT DISTINCT day FROM incoming) "
            "AND request_id IN (SELECT request_id FROM incoming)").fetchall()} if days else set()
    finally:
        con.unregister("incoming")
    if known:
        table = table.filter(pc.invert(pc.is_in(table["request_id"], pa.array(sorted(known), pa.string()))))
    if table.num_rows:
        append(lake, EVENTS, table)
        append(lake, ROLLUPS, rollups.rollup(table))
        _register(con, lake)  # this connection sees its own write
    return table.num_rows


def rejects_table(rows: list[tuple[str, str, str]], writer: str = "direct", seq: int = 0) -> pa.Table:
    """rows: (id, reason, raw) as an Arrow table of the lake's rejects schema."""
    now = dt.datetime.now(dt.UTC)
    return pa.table({"id": [r[0] for r in rows], "rejected_at": pa.array([now] * len(rows), REJECTS_SCHEMA.field(
                         "rejected_at").type),
                     "reason": [r[1] for r in rows], "raw": [r[2] for r in rows],
                     "load_writer": [writer] * len(rows), "load_seq": [seq] * len(rows)}, schema=REJECTS_SCHEMA)


def insert_rejects(con: duckdb.DuckDBPyConnection, rows: list[tuple[str, str, str]]) -> None:
    """rows: (id, reason, raw), appended to the connection's lake."""
    if rows:
        append(lake_of(con), REJECTS, rejects_table(rows))
        _register(con, lake_of(con))


def export_parquet(store_path: Path, out_dir: Path) -> list[Path]:
    """Write usage_events as Parquet partitioned by day (out_dir/usage_events/day=YYYY-MM-DD/*.parquet),
    replacing earlier exports of the same days, plus the rollups the same way and prices and gpu_hours as
    single files. (The lake itself is already Parquet; this is a plain copy for tools without Delta.)"""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with connect(store_path, read_only=True) as con:
        for view in ("usage_events", "usage_rollups"):
            con.execute(f"COPY (SELECT * FROM {view} ORDER BY day) TO '{out_dir / view}' "
                        "(FORMAT parquet, PARTITION_BY (day), OVERWRITE_OR_IGNORE true)").fetchall()
        for table in ("prices", "gpu_hours"):
            con.execute(f"COPY {table} TO '{out_dir / (table + '.parquet')}' (FORMAT parquet)").fetchall()
    return sorted(out_dir.rglob("*.parquet"))


def set_price(store_path: Path, model: str, prefill_per_m: float, cached_per_m: float,
              decode_per_m: float) -> None:
    """The operator's price for a model, in the lake (usage/price_tables.py): every pod reads it."""
    price_tables.set_price(lake_for(store_path), model, prefill_per_m, cached_per_m, decode_per_m)


def list_prices(store_path: Path) -> pd.DataFrame:
    with connect(store_path, read_only=True) as con:
        return con.execute("SELECT * FROM prices ORDER BY model = '*', model").df()


def add_gpu_hours(store_path: Path, day: str, model: str, version: str, hours: float,
                  replace: bool = False) -> None:
    """Record GPU-hours spent serving model/version on day (added to what is there unless replace)."""
    price_tables.add_gpu_hours(lake_for(store_path), [(day, model, version, hours)], replace=replace)
