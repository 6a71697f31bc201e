"""Chargeback numbers on a known data set, prices, GPU-hour allocation, Parquet export, the CLI."""
from __future__ import annotations

import datetime as dt
import json

import duckdb
import pandas as pd
import pytest

from usage import chargeback as cb
from usage import store
from usage.cli import main as cli_main

DAY1 = dt.datetime(2026, 11, 2, 12, tzinfo=dt.UTC).timestamp()
DAY2 = DAY1 + 86400


def ev(rid, ts, caller, team, adapter="", status="ok", prompt=1000, cached=200, completion=100,
       model="smollm2-135m", priority="interactive"):
    return (rid, ts, caller, team, model, "1", adapter, priority, "local", "r0", prompt, cached, completion,
            10.0, 100.0, "stop" if status == "ok" else "error", status)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "usage.duckdb"
    rows = [
        ev("a1", DAY1, "alice", "search"),
        ev("a2", DAY1, "alice", "search", adapter="lora-x"),
        ev("a3", DAY2, "alice", "search", status="error", completion=0),
        ev("b1", DAY1, "bob", "ads", prompt=3000, cached=0, completion=300, priority="batch"),
        ev("c1", DAY1, "carol", "ads", model="big-70b"),
    ]
    with store.connect(path) as con:
        assert store.insert_events(con, pd.DataFrame.from_records(rows, columns=store.EVENT_COLUMNS)) == 5
        # the same events again (a redelivery) add nothing
        assert store.insert_events(con, pd.DataFrame.from_records(rows, columns=store.EVENT_COLUMNS)) == 0
    return path


def test_token_kinds_are_metered_apart(store_path):
    df = cb.usage_summary(store_path, "2026-11-01", None, group_by=("team",)).set_index("team")
    assert df.loc["search", "requests"] == 3 and df.loc["search", "errors"] == 1
    assert df.loc["search", "prefill_tokens"] == 3 * 800
    assert df.loc["search", "cached_tokens"] == 3 * 200
    assert df.loc["search", "decode_tokens"] == 200
    assert df.loc["ads", "prefill_tokens"] == 3000 + 800
    by_day = cb.tokens_by_team_day(store_path, "2026-11-01", "2026-11-03", team="search")
    assert list(by_day["day"]) == [dt.date(2026, 11, 2)] and by_day["requests"].iloc[0] == 2
    tiers = cb.usage_summary(store_path, group_by=("tier", "adapter"))
    assert set(tiers["tier"]) == {"interactive", "batch"} and "lora-x" in set(tiers["adapter"])


def test_costs_use_per_model_prices_with_fallback(store_path):
    store.set_price(store_path, "smollm2-135m", prefill_per_m=1.0, cached_per_m=0.1, decode_per_m=2.0)
    costs = cb.cost_table(store_path, group_by=("team", "model")).set_index(["team", "model"])
    search = costs.loc[("search", "smollm2-135m")]
    assert search["cost_prefill"] == pytest.approx(2400 / 1e6)
    assert search["cost_cached"] == pytest.approx(600 * 0.1 / 1e6)
    assert search["cost_decode"] == pytest.approx(200 * 2.0 / 1e6)
    prices = store.list_prices(store_path).set_index("model")
    big = costs.loc[("ads", "big-70b")]  # no own price: the '*' row applies
    assert big["cost_decode"] == pytest.approx(100 * prices.loc["*", "decode_per_m"] / 1e6)
    total = cb.cost_table(store_path, group_by=())
    assert total["cost_total"].iloc[0] == pytest.approx(costs["cost_total"].sum())
    top = cb.top_callers(store_path, n=2)
    assert len(top) == 2 and top["cost_total"].is_monotonic_decreasing
    with pytest.raises(ValueError, match="unknown dimension"):
        cb.cost_table(store_path, group_by=("nope",))


def test_gpu_hours_follow_token_work(store_path):
    store.add_gpu_hours(store_path, "2026-11-02", "smollm2-135m", "1", 3.0)
    store.add_gpu_hours(store_path, "2026-11-02", "smollm2-135m", "1", 1.0)  # adds up
    store.add_gpu_hours(store_path, "2026-11-04", "smollm2-135m", "1", 2.0)  # no traffic that day
    df = cb.gpu_hours_by_team(store_path).set_index("team")
    # day 2 work (prefill + decode): search 2 x 900 = 1800, ads (bob) 3300 -> 4 h split 1800:3300
    assert df.loc["search", "gpu_hours"] == pytest.approx(4 * 1800 / 5100)
    assert df.loc["ads", "gpu_hours"] == pytest.approx(4 * 3300 / 5100)
    assert df.loc[cb.IDLE_TEAM, "gpu_hours"] == pytest.approx(2.0)
    assert df["share"].sum() == pytest.approx(1.0)
    only = cb.gpu_hours_by_team(store_path, team="ads", by_day=True)
    assert list(only["team"]) == ["ads"] and only["day"].iloc[0] == dt.date(2026, 11, 2)


def test_parquet_export(store_path, tmp_path):
    files = store.export_parquet(store_path, tmp_path / "pq")
    assert any("day=2026-11-02" in str(f) for f in files)
    glob = f"{tmp_path}/pq/usage_events/*/*.parquet"
    n = duckdb.connect().execute(f"SELECT count(*) FROM read_parquet('{glob}')").fetchone()[0]
    assert n == 5


def test_cli_report_formats(store_path, capsys):
    assert cli_main(["usage", "report", "--store", str(store_path), "--since", "2026-11-01", "--team", "search",
                     "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["team"] for r in rows} == {"search"} and sum(r["requests"] for r in rows) == 3
    assert cli_main(["usage", "report", "--store", str(store_path), "--since", "2026-11-01", "--by", "team,day",
                     "--format", "csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("team,day,requests") and any(line.startswith("search,2026-11-02,2") for line in out)
    assert cli_main(["usage", "report", "--store", str(store_path), "--since", "2026-11-01"]) == 0
    assert "search" in capsys.readouterr().out
    assert cli_main(["usage", "prices", "--store", str(store_path), "--set", "big-70b", "--decode", "9",
                     "--format", "json"]) == 0
    prices = {p["model"]: p for p in json.loads(capsys.readouterr().out)}
    assert prices["big-70b"]["decode_per_m"] == 9 and prices["big-70b"]["prefill_per_m"] == prices["*"]["prefill_per_m"]
    assert cli_main(["usage", "gpu-hours", "2026-11-02", "smollm2-135m", "1", "2.5", "--store", str(store_path)]) == 0
    assert cli_main(["usage", "report", "--view", "gpu-hours", "--store", str(store_path), "--since", "2026-11-01",
                     "--format", "json"]) == 0
    assert sum(r["gpu_hours"] for r in json.loads(capsys.readouterr().out)) == pytest.approx(2.5)
