"""Usage store at the requirements' scale: a synthetic seed-scale day of raw events plus a month of hourly
rollups in the usage lake, and the readers' queries on it; the same queries on today's single DuckDB file
(PRIMARY KEY request_id, chargeback over raw rows) as the peer.

Data (written straight in the store's format, not through Kafka):
- one day (--day, default 2026-11-30) of --events raw events (default 100 M) in the lake's `events` table:
  DuckDB generates the rows and writes day-partitioned Parquet, delta-rs turns the directory into a Delta
  table (`convert_to_deltalake`); 500 callers in 20 teams, each caller with its own model, adapter, tier and
  region, two versions per model;
- that day's rollups computed from the raw rows by the loader's own rollup SQL (usage/rollups.py), timed;
- the other days of the month as synthetic hourly rollups of the same shape (caller x version per hour).

Queries (each --repeat times, p50/p95 of the whole call, connect + snapshot + query):
- chargeback month-to-date by team and model: `chargeback.cost_table(group_by=("team", "model"))`;
- the forecaster's input: `autoscale.live_inputs.usage_history(model, until, weeks=3)`;
- storage bytes per event (events table Parquet bytes / events) and of the rollups.
Peer: --peer-events raw rows (default min(events, 5 M): the PRIMARY KEY index is held in memory) of the
same day in one DuckDB file, today's schema, with the pre-lake chargeback / forecaster SQL over raw rows.
Writes bench/results/usage-scale.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import duckdb  # noqa: E402
from deltalake import Field, Schema, convert_to_deltalake  # noqa: E402

from autoscale.live_inputs import usage_history  # noqa: E402
from usage import chargeback, lake, rollups, store  # noqa: E402

TEAMS, CALLERS, MODELS = 20, 500, 4

# One row per i in range(n): attributes derived from i (callers hash-spread), UTC ts within the day.
EVENTS_SQL = """
SELECT
    md5(CAST(i AS VARCHAR) || '{salt}') AS request_id,
    CAST({day_s} + i * 86400.0 / {n} AS DOUBLE) AS ts,
    'caller-' || c AS caller,
    'team-' || (c % {teams}) AS team,
    'model-' || (c % {models}) AS model,
    CASE WHEN i % 10 = 0 THEN '2' ELSE '1' END AS version,
    CASE WHEN c % 7 = 0 THEN 'lora-' || (c % 3) ELSE '' END AS adapter,
    ['interactive', 'standard', 'batch'][1 + c % 3] AS priority,
    ['us-east', 'eu-west'][1 + c % 2] AS region,
    'replica-' || (i % 16) AS replica_id,
    200 + p AS prompt_tokens,
    p // 3 AS cached_prompt_tokens,
    20 + CAST(hash(i * 13) % 400 AS BIGINT) AS completion_tokens,
    CAST(20 + hash(i * 17) % 300 AS DOUBLE) AS ttft_ms,
    CAST(400 + hash(i * 19) % 9000 AS DOUBLE) AS duration_ms,
    CASE WHEN i % 200 = 0 THEN 'error' ELSE 'stop' END AS finish_reason,
    CASE WHEN i % 200 = 0 THEN 'error' ELSE 'ok' END AS status,
    CAST('{day}' AS DATE) AS day
FROM (SELECT i, CAST(hash(i) % {callers} AS BIGINT) AS c, CAST(hash(i * 7) % 1800 AS BIGINT) AS p
      FROM range({n}) t(i))"""

# Hourly rollups of the other days: caller x version per hour, sums of the same order as the raw day's.
ROLLUP_DAYS_SQL = """
SELECT CAST(d AS DATE) AS day, CAST(epoch(d) + h * 3600 AS DOUBLE) AS hour,
    'team-' || (c % {teams}) AS team, 'caller-' || c AS caller, 'model-' || (c % {models}) AS model,
    CAST(v AS VARCHAR) AS version,
    CASE WHEN c % 7 = 0 THEN 'lora-' || (c % 3) ELSE '' END AS adapter,
    ['interactive', 'standard', 'batch'][1 + c % 3] AS priority, ['us-east', 'eu-west'][1 + c % 2] AS region,
    CAST(r AS BIGINT) AS requests, CAST(r / 200 AS BIGINT) AS errors, CAST(0 AS BIGINT) AS cancelled,
    CAST(r * 700 AS BIGINT) AS prefill_tokens, CAST(r * 300 AS BIGINT) AS cached_tokens,
    CAST(r * 220 AS BIGINT) AS decode_tokens, CAST(r * 170 AS DOUBLE) AS ttft_ms_sum,
    CAST(r * 4900 AS DOUBLE) AS duration_ms_sum
FROM (SELECT d, h, c, v, ({per_hour} / {callers}) * (CASE WHEN v = 2 THEN 0.1 ELSE 0.9 END)
             * (1 + ((c * 31 + h) % 10) / 10.0) AS r
      FROM range(TIMESTAMP '{first}', TIMESTAMP '{last}', INTERVAL 1 DAY) a(d), range(24) b(h),
           range({callers}) x(c), range(1, 3) y(v))"""


def timed(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_s": round(statistics.median(times), 4), "p95_s": round(times[min(len(times) - 1,
                                                                                   int(len(times) * 0.95))], 4),
            "runs": repeat}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.parquet"))


def build_lake(work: Path, n: int, day: dt.date, threads: int) -> dict:
    path = work / "usage.duckdb"
    lk = store.lake_for(path)
    events_dir = Path(lk.table_uri(lake.EVENTS))
    events_dir.mkdir(parents=True)
    day_s = dt.datetime.combine(day, dt.time(0), dt.UTC).timestamp()
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.execute("SET enable_progress_bar = false")
    t0 = time.perf_counter()
    sql = EVENTS_SQL.format(salt="lake", day_s=day_s, n=n, callers=CALLERS, teams=TEAMS, models=MODELS, day=day)
    # the generated columns (+ day), no trace ids (nullable), loader bookkeeping constant
    cols = ", ".join(n for n in lake.EVENTS_SCHEMA.names[:-3] if n not in dict(lake.OPTIONAL_EVENT_FIELDS))
    con.execute(f"COPY (SELECT {cols}, CAST(NULL AS VARCHAR) AS trace_id, 'bench' AS load_writer, "
                f"CAST(0 AS BIGINT) AS load_seq, "
                f"{day_s + 86400.0} AS loaded_at FROM ({sql})) TO '{events_dir}' "
                "(FORMAT parquet, PARTITION_BY (day), ROW_GROUP_SIZE 1000000, COMPRESSION zstd)")
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert_to_deltalake(str(events_dir), partition_by=Schema([Field("day", "date")]),
                         partition_strategy="hive")
    t_convert = time.perf_counter() - t0
    t0 = time.perf_counter()
    day_rollup = rollups.rollup(lake.dataset(lk, lake.EVENTS))
    t_rollup = time.perf_counter() - t0
    lake.append(lk, lake.ROLLUPS, day_rollup)
    first = day.replace(day=1)
    per_hour = n / 24
    other = con.sql(ROLLUP_DAYS_SQL.format(teams=TEAMS, models=MODELS, callers=CALLERS, per_hour=per_hour,
                                               first=first, last=day)).to_arrow_table() if day > first else None
    if other is not None:
        for d in range(0, other.num_rows, 2_000_000):
            lake.append(lk, lake.ROLLUPS, other.slice(d, 2_000_000))
    con.close()
    return {"path": path, "lake": lk, "generate_write_s": round(t_gen, 1), "convert_to_delta_s": round(t_convert, 1),
            "rollup_of_the_day_s": round(t_rollup, 1), "rollup_rows_day": day_rollup.num_rows,
            "rollup_rows_month": day_rollup.num_rows + (other.num_rows if other is not None else 0),
            "events_bytes": dir_bytes(events_dir), "rollups_bytes": dir_bytes(Path(lk.table_uri(lake.ROLLUPS)))}


PEER_COST_SQL = """
    WITH u AS (SELECT team, model, count(*) AS requests, sum(prompt_tokens - cached_prompt_tokens) AS prefill,
                      sum(cached_prompt_tokens) AS cached, sum(completion_tokens) AS decode
               FROM usage_events WHERE day >= ? AND day < ? GROUP BY ALL)
    SELECT u.team, u.model, requests, prefill * 0.5 / 1e6 + cached * 0.05 / 1e6 + decode * 1.5 / 1e6 AS cost
    FROM u ORDER BY cost DESC"""
PEER_FORECAST_SQL = ("SELECT floor(ts / 3600) AS hour, count(*) AS n FROM usage_events "
                     "WHERE model = ? AND priority <> 'batch' AND ts >= ? AND ts < ? GROUP BY 1 ORDER BY 1")


def build_peer(work: Path, n: int, day: dt.date, threads: int) -> dict:
    """Today's store: one DuckDB file, PRIMARY KEY request_id, filled in loader-sized batches."""
    path = work / "peer.duckdb"
    day_s = dt.datetime.combine(day, dt.time(0), dt.UTC).timestamp()
    con = duckdb.connect(str(path))
    con.execute(f"SET threads = {threads}")
    con.execute("SET enable_progress_bar = false")
    ddl = ", ".join(f"{f.name} {'VARCHAR' if str(f.type) == 'string' else 'BIGINT' if f.type == 'int64' else 'DOUBLE'}"
                    + (" PRIMARY KEY" if f.name == "request_id" else "") for f in lake.EVENTS_SCHEMA
                    if f.name not in ("day", "load_writer", "load_seq", "loaded_at", *dict(lake.OPTIONAL_EVENT_FIELDS)))
    con.execute(f"CREATE TABLE usage_events ({ddl}, day DATE NOT NULL)")
    t0 = time.perf_counter()
    step = 5_000_000
    for lo in range(0, n, step):
        sql = EVENTS_SQL.format(salt="lake", day_s=day_s, n=n, callers=CALLERS, teams=TEAMS, models=MODELS, day=day)
        sql = sql.replace(f"FROM range({n}) t(i)", f"FROM range({lo}, {min(n, lo + step)}) t(i)")
        assert str(lo + 1) in sql or lo == 0
        con.execute(f"INSERT OR IGNORE INTO usage_events {sql}")
    con.execute("CHECKPOINT")
    t_load = time.perf_counter() - t0
    con.close()
    return {"path": path, "insert_s": round(t_load, 1), "file_bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--events", type=int, default=100_000_000, help="raw events of the day (default: %(default)s)")
    parser.add_argument("--peer-events", type=int, default=None, help="raw rows in the peer DuckDB file "
                        "(default: min(events, 5 M), queries extrapolated linearly; 0 = no peer)")
    parser.add_argument("--day", type=dt.date.fromisoformat, default=dt.date(2026, 11, 30))
    parser.add_argument("--repeat", type=int, default=20, help="runs per query (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="DuckDB threads for generation (default: %(default)s)")
    parser.add_argument("--work", type=Path, help="keep the data here (default: a temp dir, removed)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "usage-scale.json")
    args = parser.parse_args(argv)
    peer_n = min(args.events, 5_000_000) if args.peer_events is None else args.peer_events
    work = args.work or Path(tempfile.mkdtemp(prefix="usage-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "usage-scale", "host": platform.node(), "cpus": os.cpu_count(),
                    "events_day": args.events, "day": str(args.day), "load_average_start": os.getloadavg()}
    since, until = args.day.replace(day=1), args.day + dt.timedelta(days=1)
    until_s = dt.datetime.combine(until, dt.time(0), dt.UTC).timestamp()
    try:
        print(f"lake: {args.events:,} events on {args.day} + rollups since {since} ...", flush=True)
        built = build_lake(work, args.events, args.day, args.threads)
        path = built.pop("path")
        built.pop("lake")
        result["lake"] = {**built, "events_bytes_per_event": round(built["events_bytes"] / args.events, 2)}
        print(json.dumps(result["lake"]), flush=True)
        mtd = chargeback.cost_table(path, since, until, group_by=("team", "model"))
        result["lake"]["chargeback_mtd_team_model"] = {
            **timed(lambda: chargeback.cost_table(path, since, until, group_by=("team", "model")), args.repeat),
            "rows": len(mtd), "requests": int(mtd["requests"].sum())}
        hist = usage_history(path, "model-0", until_s, weeks=3)
        result["lake"]["forecaster_input_3_weeks"] = {
            **timed(lambda: usage_history(path, "model-0", until_s, weeks=3), args.repeat),
            "hours": len(hist), "requests": float(hist.sum())}
        print(json.dumps(result["lake"]), flush=True)
        if peer_n:
            print(f"peer: one DuckDB file with {peer_n:,} raw rows (PRIMARY KEY request_id) ...", flush=True)
            peer = build_peer(work, peer_n, args.day, args.threads)
            ppath = peer.pop("path")
            result["peer_duckdb_file"] = {**peer, "events": peer_n,
                                          "bytes_per_event": round(peer["file_bytes"] / peer_n, 2)}

            def q(sql, params):
                with duckdb.connect(str(ppath), read_only=True) as con:
                    return con.execute(sql, params).fetchall()
            result["peer_duckdb_file"]["chargeback_mtd_team_model"] = timed(
                lambda: q(PEER_COST_SQL, [since, until]), max(3, args.repeat // 4))
            result["peer_duckdb_file"]["forecaster_input_3_weeks"] = timed(
                lambda: q(PEER_FORECAST_SQL, ["model-0", until_s - 21 * 86400, until_s]), max(3, args.repeat // 4))
            print(json.dumps(result["peer_duckdb_file"]), flush=True)
    finally:
        result["load_average_end"] = os.getloadavg()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["command"] = "python bench/usage/bench_scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
