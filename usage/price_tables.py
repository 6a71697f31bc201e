"""Prices and GPU-hours as Delta tables in the usage lake (usage/lake.py), so every pod that reads usage
(admin UI, autoscaler, loader, routers' budgets, rollback rule) reads the operator's prices, not defaults.

Why the lake and not the registry's PostgreSQL: every reader of chargeback already reaches the lake (same
URI and credentials as the events), chargeback joins prices inside the same DuckDB query as the rollups, and
the embedded `make up` keeps working with a local directory and no extra service. Edits are rare (an
operator's `fleet usage prices --set`, the scraper's GPU-hours every minute), so each is one Delta MERGE
commit; a concurrent edit that loses the commit race is retried on the new snapshot.

Tables under the lake's base URI:
- `prices/`: one row per model (`*` = fallback): prefill / cached-prefix / decode price per 1M tokens, and
  when it was set. Models without an operator row read `DEFAULT_PRICES` (the `prices` view merges them).
- `gpu_hours/`: one row per (day, model, version) with the GPU-hours spent serving it.
"""
from __future__ import annotations

import datetime as dt
import time

import pyarrow as pa
from deltalake import write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from usage.lake import Lake, open_table

PRICES, GPU_HOURS = "prices", "gpu_hours"

DEFAULT_PRICES = [
    # model, prefill, cached, decode (per 1M tokens). Cached prefix tokens are billed at 10 % of prefill:
    # they cost a KV-cache hit, not compute.
    ("smollm2-135m", 0.05, 0.005, 0.20),
    ("*", 0.50, 0.05, 1.50),
]

PRICES_SCHEMA = pa.schema([("model", pa.string()), ("prefill_per_m", pa.float64()), ("cached_per_m", pa.float64()),
                           ("decode_per_m", pa.float64()), ("updated_at", pa.timestamp("us", tz="UTC"))])
GPU_HOURS_SCHEMA = pa.schema([("day", pa.date32()), ("model", pa.string()), ("version", pa.string()),
                              ("gpu_hours", pa.float64())])
_KEYS = {PRICES: ["model"], GPU_HOURS: ["day", "model", "version"]}
_SCHEMAS = {PRICES: PRICES_SCHEMA, GPU_HOURS: GPU_HOURS_SCHEMA}
MERGE_ATTEMPTS = 20


def _merge(lake: Lake, table: str, rows: pa.Table, updates: dict[str, str] | None) -> None:
    """Upsert `rows` by the table's key: matched rows get `updates` (None = keep the target row), new keys
    are inserted. Retried when another writer committed first (Delta's optimistic concurrency)."""
    rows = rows.cast(_SCHEMAS[table])
    uri = lake.table_uri(table)
    opts = lake.storage_options or None
    predicate = " AND ".join(f"t.{k} = s.{k}" for k in _KEYS[table])
    for attempt in range(MERGE_ATTEMPTS):
        try:
            target = open_table(lake, table)
            if target is None:
                write_deltalake(uri, rows, mode="append", storage_options=opts)
                return
            merger = target.merge(rows, predicate, source_alias="s", target_alias="t")
            if updates is not None:
                merger = merger.when_matched_update(updates)
            merger.when_not_matched_insert_all().execute()
            return
        except (CommitFailedError, DeltaError) as exc:
            # Lost the race (a version or the table's creation committed by someone else): retry on the new
            # snapshot. Anything else (bad credentials, bad data) is not a race: raise it.
            if attempt == MERGE_ATTEMPTS - 1 or not _is_conflict(exc):
                raise
            time.sleep(0.01 * (attempt + 1))


def _is_conflict(exc: Exception) -> bool:
    text = str(exc).lower()
    return isinstance(exc, CommitFailedError) or "conflict" in text or "already exists" in text or "version" in text


def set_price(lake: Lake, model: str, prefill_per_m: float, cached_per_m: float, decode_per_m: float) -> None:
    """The operator's price for `model` ('*' = every model without its own row), replacing any earlier one."""
    for name, value in (("prefill_per_m", prefill_per_m), ("cached_per_m", cached_per_m),
                        ("decode_per_m", decode_per_m)):
        if not (value >= 0 and value < float("inf")):
            raise ValueError(f"{name}: {value!r} is not a price; give a finite number >= 0 per 1M tokens")
    if not model or len(model) > 200:
        raise ValueError("model: give the model name (1-200 characters) or '*' for the fallback price")
    row = pa.table({"model": [model], "prefill_per_m": [float(prefill_per_m)], "cached_per_m": [float(cached_per_m)],
                    "decode_per_m": [float(decode_per_m)], "updated_at": [dt.datetime.now(dt.UTC)]},
                   schema=PRICES_SCHEMA)
    _merge(lake, PRICES, row, {c: f"s.{c}" for c in PRICES_SCHEMA.names if c != "model"})


def add_gpu_hours(lake: Lake, rows: list[tuple[dt.date | str, str, str, float]], replace: bool = False) -> None:
    """GPU-hours per (day, model, version), added to what is stored (or replacing it), in one commit."""
    if not rows:
        return
    days = [d if isinstance(d, dt.date) else dt.date.fromisoformat(str(d)) for d, *_ in rows]
    table = pa.table({"day": days, "model": [r[1] for r in rows], "version": [r[2] for r in rows],
                      "gpu_hours": [float(r[3]) for r in rows]}, schema=GPU_HOURS_SCHEMA)
    if not replace:  # several rows for one key in one call: sum them first (MERGE wants one source row per key)
        table = table.group_by(["day", "model", "version"]).aggregate([("gpu_hours", "sum")]).rename_columns(
            ["day", "model", "version", "gpu_hours"]).select(GPU_HOURS_SCHEMA.names)
    update = "s.gpu_hours" if replace else "t.gpu_hours + s.gpu_hours"
    _merge(lake, GPU_HOURS, table, {"gpu_hours": update})


def import_rows(lake: Lake, table: str, rows: pa.Table) -> None:
    """Rows from a pre-lake control file: keys already in the lake win (so a re-run is a no-op)."""
    if rows.num_rows:
        _merge(lake, table, rows, None)


def register(con, lake: Lake) -> None:
    """`prices` (operator rows, then the defaults for models without one) and `gpu_hours` as DuckDB views."""
    prices = open_table(lake, PRICES)
    gpu = open_table(lake, GPU_HOURS)
    # Small tables (models x versions x days): read whole, cast to plain strings (delta-rs hands string_view,
    # which pyarrow cannot compare when DuckDB pushes a filter down).
    con.register("lake_prices", prices.to_pyarrow_table().cast(PRICES_SCHEMA) if prices
                 else PRICES_SCHEMA.empty_table())
    con.register("lake_gpu_hours", gpu.to_pyarrow_table().cast(GPU_HOURS_SCHEMA) if gpu
                 else GPU_HOURS_SCHEMA.empty_table())
    defaults = pa.table({"model": [p[0] for p in DEFAULT_PRICES], "prefill_per_m": [p[1] for p in DEFAULT_PRICES],
                         "cached_per_m": [p[2] for p in DEFAULT_PRICES], "decode_per_m": [p[3] for p in DEFAULT_PRICES],
                         "updated_at": pa.array([None] * len(DEFAULT_PRICES), PRICES_SCHEMA.field("updated_at").type)},
                        schema=PRICES_SCHEMA)
    con.register("default_prices", defaults)
    # One row per key whatever happened: two writers creating a table at once both append their row, so the
    # latest price wins and GPU-hours of one key add up (which is what `add_gpu_hours` means).
    con.execute("CREATE OR REPLACE TEMP VIEW prices AS SELECT * FROM (SELECT * FROM lake_prices QUALIFY "
                "row_number() OVER (PARTITION BY model ORDER BY updated_at DESC) = 1) UNION ALL "
                "SELECT * FROM default_prices WHERE model NOT IN (SELECT model FROM lake_prices)")
    con.execute("CREATE OR REPLACE TEMP VIEW gpu_hours AS SELECT day, model, version, sum(gpu_hours) AS gpu_hours "
                "FROM lake_gpu_hours GROUP BY ALL")

