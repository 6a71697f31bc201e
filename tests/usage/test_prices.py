"""Prices and GPU-hours live in the lake (usage/price_tables.py): a process on another "node" (no control
file, only the lake URI) reads the operator's prices in chargeback and in the routers' budget price book."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import duckdb
import pandas as pd
import pytest

from usage import chargeback, price_tables, store
from usage.lake import Lake

READER = """
import json, sys
from pathlib import Path
from router_service.budgets import PriceBook
from usage import chargeback, store
path = Path(sys.argv[1])
assert not path.exists()
book = PriceBook(path)
book.reload()
cost = chargeback.cost_table(path, group_by=("team",))
hours = chargeback.gpu_hours_by_team(path)
print(json.dumps({"book": book.rates("smollm2-135m"), "fallback": book.rates("other"),
                  "cost": float(cost["cost_total"].sum()), "gpu_hours": float(hours["gpu_hours"].sum())}))
"""


def test_a_reader_without_the_control_file_sees_the_operators_prices(tmp_path, make_event):
    lake_dir = tmp_path / "shared.lake"
    env = {**os.environ, "FLEET_USAGE_LAKE_URI": str(lake_dir)}
    writer_store = tmp_path / "writer" / "usage.duckdb"
    lake = Lake(str(lake_dir))
    with store.connect(writer_store, lake=lake) as con:
        store.insert_events(con, pd.DataFrame([make_event(f"r{i}").model_dump() for i in range(10)]))
    # the operator sets prices on one box (the CLI, through the lake given by FLEET_USAGE_LAKE_URI)
    cli = [sys.executable, "-c", "from fleet.cli import main; main()"]
    subprocess.run([*cli, "usage", "prices", "--store", str(writer_store), "--set", "smollm2-135m",
                    "--prefill", "2", "--cached", "1", "--decode", "4"], env=env, check=True, capture_output=True)
    today = dt.datetime.now(dt.UTC).date()
    price_tables.add_gpu_hours(lake, [(today, "smollm2-135m", "1", 1.5), (today, "smollm2-135m", "1", 0.5)])
    price_tables.add_gpu_hours(lake, [(str(today), "smollm2-135m", "1", 1.0)])
    out = subprocess.run([sys.executable, "-c", READER, str(tmp_path / "elsewhere" / "usage.duckdb")], env=env,
                         check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["book"] == [2.0, 1.0, 4.0]
    assert got["fallback"] == [0.5, 0.05, 1.5]  # no operator row for '*': the default stays
    # 10 events x (60 uncached x 2 + 40 cached x 1 + 20 decode x 4) per 1M tokens
    assert got["cost"] == pytest.approx(10 * (60 * 2 + 40 * 1 + 20 * 4) / 1e6)
    assert got["gpu_hours"] == pytest.approx(3.0)
    price_tables.set_price(lake, "smollm2-135m", 3, 1, 4)  # an edit replaces the row, never adds one
    with store.connect(tmp_path / "nowhere.duckdb", read_only=True, lake=lake) as con:
        assert con.execute("SELECT count(*), max(prefill_per_m) FROM prices WHERE model = 'smollm2-135m'"
                           ).fetchall() == [(1, 3.0)]
    assert chargeback.cost_table(tmp_path / "nowhere.duckdb", group_by=("team",)) is not None


def test_bad_prices_are_refused_with_the_field(tmp_path):
    lake = Lake(str(tmp_path / "l.lake"))
    with pytest.raises(ValueError, match="decode_per_m"):
        price_tables.set_price(lake, "m", 1, 1, float("nan"))
    with pytest.raises(ValueError, match="prefill_per_m"):
        price_tables.set_price(lake, "m", -1, 1, 1)


def test_a_control_file_with_prices_moves_them_into_the_lake(tmp_path):
    path = tmp_path / "usage.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE prices (model VARCHAR PRIMARY KEY, prefill_per_m DOUBLE, cached_per_m DOUBLE, "
                "decode_per_m DOUBLE, updated_at TIMESTAMP DEFAULT current_timestamp)")
    con.execute("INSERT INTO prices VALUES ('m', 7, 1, 9, now())")
    con.execute("CREATE TABLE gpu_hours (day DATE, model VARCHAR, version VARCHAR, gpu_hours DOUBLE, "
                "PRIMARY KEY (day, model, version))")
    con.execute("INSERT INTO gpu_hours VALUES (DATE '2026-01-02', 'm', '1', 5)")
    con.close()
    for _ in range(2):  # the second open finds nothing left to move
        with store.connect(path):
            pass
    prices = store.list_prices(path).set_index("model")
    assert prices.loc["m", "prefill_per_m"] == 7 and prices.loc["*", "prefill_per_m"] == 0.5
    assert chargeback.gpu_hours_by_team(path, since="2026-01-01", until="2026-01-03")["gpu_hours"].sum() == 5


def test_concurrent_gpu_hour_adds_all_count(tmp_path):
    """Two writers adding GPU-hours to the same key at once (the scraper and an operator): each MERGE that
    loses the commit race is retried on the new snapshot, so no addition is lost."""
    import threading
    lake = Lake(str(tmp_path / "l.lake"))
    price_tables.add_gpu_hours(lake, [("2026-01-02", "m", "1", 0.0)])

    def add() -> None:
        for _ in range(10):
            price_tables.add_gpu_hours(lake, [("2026-01-02", "m", "1", 0.5)])
    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with store.connect(tmp_path / "none.duckdb", read_only=True, lake=lake) as con:
        assert con.execute("SELECT sum(gpu_hours) FROM gpu_hours").fetchall()[0][0] == pytest.approx(10.0)
