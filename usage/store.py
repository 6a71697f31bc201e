"""The columnar usage store: one DuckDB file (Parquet export on demand).

Tables
- `usage_events`: the `UsageEvent` columns (docs/architecture.md, Usage events) + `day` (UTC date of
  `ts`); PRIMARY KEY request_id, so a re-delivered event (Kafka redelivery after a crash, a spool resend)
  is ignored on insert.
- `usage_rejects`: events the loader refused (schema, negative tokens, unknown caller), with the reason.
- `prices`: per-model prices in currency units per 1M tokens for prefill, cached-prefix and decode tokens;
  model '*' is the fallback for models without their own row.
- `gpu_hours`: GPU-hours the fleet spent per (day, model, version), written by whoever runs replicas
  (the autoscaler / `fleet usage gpu-hours`); chargeback allocates them to teams.

Locking: DuckDB lets one process write *or* many read a file, never both. So nobody keeps the file open:
the loader opens it per batch (~20 ms) and readers (CLI, admin UI) open it read-only per query, and
both retry while the other side holds it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pandas as pd

EVENT_COLUMNS = ["request_id", "ts", "caller", "team", "model", "version", "adapter", "priority", "region",
                 "replica_id", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "ttft_ms",
                 "duration_ms", "finish_reason", "status"]

DEFAULT_PRICES = [
    # model, prefill, cached, decode (per 1M tokens). Cached prefix tokens are billed at 10 % of prefill:
    # they cost a KV-cache hit, not compute.
    ("smollm2-135m", 0.05, 0.005, 0.20),
    ("*", 0.50, 0.05, 1.50),
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_events (
    request_id VARCHAR PRIMARY KEY,
    ts DOUBLE NOT NULL,
    caller VARCHAR NOT NULL,
    team VARCHAR NOT NULL,
    model VARCHAR NOT NULL,
    version VARCHAR NOT NULL,
    adapter VARCHAR NOT NULL,
    priority VARCHAR NOT NULL,
    region VARCHAR NOT NULL,
    replica_id VARCHAR NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    ttft_ms DOUBLE NOT NULL,
    duration_ms DOUBLE NOT NULL,
    finish_reason VARCHAR NOT NULL,
    status VARCHAR NOT NULL,
    day DATE NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_rejects (
    id VARCHAR PRIMARY KEY,          -- topic/partition/offset/crc: a redelivered reject is counted once
    rejected_at TIMESTAMP NOT NULL,
    reason VARCHAR NOT NULL,
    raw VARCHAR NOT NULL
);
CREATE TABLE IF NOT EXISTS prices (
    model VARCHAR PRIMARY KEY,
    prefill_per_m DOUBLE NOT NULL,
    cached_per_m DOUBLE NOT NULL,
    decode_per_m DOUBLE NOT NULL,
    updated_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);
CREATE TABLE IF NOT EXISTS gpu_hours (
    day DATE NOT NULL,
    model VARCHAR NOT NULL,
    version VARCHAR NOT NULL,
    gpu_hours DOUBLE NOT NULL,
    PRIMARY KEY (day, model, version)
);
"""

LOCK_RETRY_S = 30.0


def _is_lock_error(exc: Exception) -> bool:
    # Another process holds the file lock, or (same process) a connection with another read_only mode.
    text = str(exc).lower()
    return "lock" in text or "different configuration" in text


@contextmanager
def connect(store_path: Path, read_only: bool = False, timeout_s: float = LOCK_RETRY_S
            ) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the store briefly (creating it with the schema on first use), retrying while another
    process holds the file."""
    store_path = Path(store_path)
    if read_only and not store_path.exists():
        with connect(store_path, read_only=False, timeout_s=timeout_s):
            pass
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
    try:
        if not read_only:
            _ensure_schema(con)
        yield con
    finally:
        con.close()


def _ensure_schema(con: duckdb.DuckDBPyConnection) -> None:
    # fetchall, not fetchone: DuckDB 2 refuses other work on a connection with an unfinished result.
    if con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'prices'").fetchall()[0][0]:
        return
    con.execute(SCHEMA)
    con.executemany("INSERT OR IGNORE INTO prices (model, prefill_per_m, cached_per_m, decode_per_m) "
                    "VALUES (?, ?, ?, ?)", DEFAULT_PRICES)


def insert_events(con: duckdb.DuckDBPyConnection, frame: pd.DataFrame) -> int:
    """Insert valid events (columns = EVENT_COLUMNS), ignoring request_ids already stored.
    Returns the number of new rows. The caller de-duplicates inside the frame."""
    if frame.empty:
        return 0
    con.register("incoming", frame)
    try:
        cols = ", ".join(EVENT_COLUMNS)
        # day = UTC date: epoch_ms gives a naive UTC timestamp, so no time-zone setting is involved.
        # INSERT OR IGNORE answers with the number of rows it really inserted.
        return con.execute(f"INSERT OR IGNORE INTO usage_events ({cols}, day) "
                           f"SELECT {cols}, CAST(epoch_ms(CAST(ts * 1000 AS BIGINT)) AS DATE) FROM incoming"
                           ).fetchall()[0][0]
    finally:
        con.unregister("incoming")


def insert_rejects(con: duckdb.DuckDBPyConnection, rows: list[tuple[str, str, str]]) -> None:
    """rows: (id, reason, raw)."""
    if rows:
        con.executemany("INSERT OR IGNORE INTO usage_rejects (id, rejected_at, reason, raw) "
                        "VALUES (?, current_timestamp, ?, ?)", rows)


def export_parquet(store_path: Path, out_dir: Path) -> list[Path]:
    """Write usage_events as Parquet partitioned by day (out_dir/day=YYYY-MM-DD/*.parquet), replacing
    earlier exports of the same days, plus prices and gpu_hours as single files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with connect(store_path, read_only=True) as con:
        con.execute(f"COPY (SELECT * FROM usage_events ORDER BY day, ts) TO '{out_dir / 'usage_events'}' "
                    "(FORMAT parquet, PARTITION_BY (day), OVERWRITE_OR_IGNORE true)").fetchall()
        for table in ("prices", "gpu_hours"):
            con.execute(f"COPY {table} TO '{out_dir / (table + '.parquet')}' (FORMAT parquet)").fetchall()
    return sorted(out_dir.rglob("*.parquet"))


def set_price(store_path: Path, model: str, prefill_per_m: float, cached_per_m: float,
              decode_per_m: float) -> None:
    with connect(store_path) as con:
        con.execute("INSERT OR REPLACE INTO prices VALUES (?, ?, ?, ?, current_timestamp)",
                    [model, prefill_per_m, cached_per_m, decode_per_m]).fetchall()


def list_prices(store_path: Path) -> pd.DataFrame:
    with connect(store_path, read_only=True) as con:
        return con.execute("SELECT * FROM prices ORDER BY model = '*', model").df()


def add_gpu_hours(store_path: Path, day: str, model: str, version: str, hours: float,
                  replace: bool = False) -> None:
    """Record GPU-hours spent serving model/version on day (added to what is there unless replace)."""
    with connect(store_path) as con:
        update = "excluded.gpu_hours" if replace else "gpu_hours.gpu_hours + excluded.gpu_hours"
        con.execute("INSERT INTO gpu_hours VALUES (CAST(? AS DATE), ?, ?, ?) "
                    f"ON CONFLICT (day, model, version) DO UPDATE SET gpu_hours = {update}",
                    [day, model, version, hours]).fetchall()
