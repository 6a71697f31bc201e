"""Hourly usage rollups: what chargeback, budgets, the forecaster and the admin UI read instead of raw events.

One rollup row = one (UTC hour, team, caller, model, version, adapter, priority, region) with requests,
errors, cancelled, prefill/cached/decode tokens and TTFT / duration sums. The loader appends the rollup of
each batch in its own Delta commit (usage/loader.py makes that exactly once), so an hour is spread over
several *partial* rows until compaction (usage/retention.py) merges a closed day into one row per group.
Readers therefore always `sum()` over the group, never pick a row.

At the requirements' rate (100 M events a day) a day of raw events becomes a few thousand rollup rows per
hour at most (the product of the dimensions actually seen), so a month-to-date chargeback scans thousands,
not billions, of rows.
"""
from __future__ import annotations

import duckdb
import pyarrow as pa

from usage.lake import ROLLUP_DIMS, ROLLUPS_SCHEMA

_DIMS = ", ".join(ROLLUP_DIMS)

# Per-event terms; the prefill/cached/decode split is the one of usage/chargeback.py's module docstring.
ROLLUP_SQL = f"""
    SELECT day, floor(ts / 3600) * 3600 AS hour, {_DIMS},
        count(*) AS requests,
        count(*) FILTER (WHERE status = 'error') AS errors,
        count(*) FILTER (WHERE status = 'cancelled') AS cancelled,
        sum(prompt_tokens - cached_prompt_tokens) AS prefill_tokens,
        sum(cached_prompt_tokens) AS cached_tokens,
        sum(completion_tokens) AS decode_tokens,
        sum(ttft_ms) AS ttft_ms_sum,
        sum(duration_ms) AS duration_ms_sum
    FROM {{src}} GROUP BY ALL"""

# Merge partial rollup rows (compaction): same keys, summed measures.
MERGE_SQL = f"""
    SELECT day, hour, {_DIMS}, sum(requests) AS requests, sum(errors) AS errors, sum(cancelled) AS cancelled,
        sum(prefill_tokens) AS prefill_tokens, sum(cached_tokens) AS cached_tokens,
        sum(decode_tokens) AS decode_tokens, sum(ttft_ms_sum) AS ttft_ms_sum, sum(duration_ms_sum) AS duration_ms_sum
    FROM {{src}} GROUP BY ALL ORDER BY hour, {_DIMS}"""


def _run(sql: str, table) -> pa.Table:
    con = duckdb.connect()
    try:
        con.register("src", table)
        return con.sql(sql.format(src="src")).to_arrow_table().cast(ROLLUPS_SCHEMA)
    finally:
        con.close()


def rollup(events: pa.Table) -> pa.Table:
    """The hourly rollup rows of a batch of events (columns of usage.lake.EVENTS_SCHEMA, `day` included)."""
    return _run(ROLLUP_SQL, events)


def merge(partials) -> pa.Table:
    """One row per (hour, dimensions) from partial rollup rows (an Arrow table or dataset)."""
    return _run(MERGE_SQL, partials)
