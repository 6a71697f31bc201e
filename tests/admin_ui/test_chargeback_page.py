"""Chargeback page driven by AppTest on a real store and registry: month to date by default, every filter,
totals equal to usage.chargeback (what `fleet usage report` prints), unit cost, budgets (set through the
router, audited) with the overrun warning, GPU-hours with the idle share, CSV / Parquet export."""
from __future__ import annotations

import datetime as dt
import io

import pandas as pd
import pyarrow.parquet as pq
import pytest

from registry import queries
from registry.db import session_scope
from tests.admin_ui.stack import MODEL
from usage import chargeback, store


def _text(elements) -> str:
    return " | ".join(str(e.value) for e in elements)


def _metric(at, prefix: str) -> str:
    return next(m.value for m in at.metric if m.label.startswith(prefix))


def _report_total(stack, **filters) -> float:
    today = dt.datetime.now(dt.timezone.utc).date()
    got = chargeback.cost_table(stack.data_dir / "usage.duckdb", today.replace(day=1), today + dt.timedelta(days=1),
                                group_by=(), filters=filters)
    return round(float(got["cost_total"].sum()), 6) if not got.empty else 0.0


def test_month_to_date_totals_match_the_report_and_the_chart_covers_every_day(stack, page):
    at = page("chargeback")
    assert not at.exception, at.exception
    today = dt.datetime.now(dt.timezone.utc).date()
    assert at.date_input(key="cb_dates").value == (today.replace(day=1), today)
    assert float(_metric(at, "cost (USD)").replace(",", "")) == pytest.approx(_report_total(stack), abs=1e-6)
    assert _metric(at, "requests") == "60"
    chart = at.get("plotly_chart")[0].proto.spec
    assert '"type":"date"' in chart.replace(" ", ""), "a continuous date axis"
    breakdown = next(d.value for d in at.dataframe if "tier" in d.value.columns and "cost_total" in d.value.columns)
    assert set(breakdown["team"]) == {"search", "assistant"} and (breakdown["cost_total"] > 0).all()


@pytest.mark.parametrize("dim, value, requests", [("team", "search", 30), ("version", "2", 20),
                                                  ("caller", "chat-svc", 30), ("tier", "interactive", 60)])
def test_each_filter_narrows_the_totals_and_lands_in_the_url(stack, page, dim, value, requests):
    at = page("chargeback")
    at.selectbox(key=f"cb_{dim}").select(value).run()
    assert not at.exception, at.exception
    assert _metric(at, "requests") == str(requests)
    assert float(_metric(at, "cost (USD)").replace(",", "")) == pytest.approx(_report_total(stack, **{dim: value}),
                                                                             abs=1e-6)
    assert at.query_params[dim] == value


def test_unit_cost_per_million_tokens_by_team_and_model(stack, page):
    at = page("chargeback")
    units = next(d.value for d in at.dataframe if "cost_per_1m_tokens" in d.value.columns)
    assert set(units["model"]) == {MODEL}
    row = units.iloc[0]
    assert row["cost_per_1m_tokens"] == pytest.approx(row["cost_total"] / row["tokens"] * 1e6, rel=1e-4)


def test_operator_sets_a_budget_and_an_overrun_warning_appears(stack, page):
    at = page("chargeback")
    assert "will overrun" not in _text(at.warning)
    at.selectbox(key="budget_team").select("search")
    at.number_input(key="budget_amount").set_value(0.000001)
    next(b for b in at.button if b.label == "Set budget").click().run()
    assert not at.exception and "Not changed" not in _text(at.error), _text(at.error)
    with session_scope(stack.db_url) as s:
        assert [(a.action, a.target) for a in queries.list_audit(s, 1)] == [("set_budget", "search")]
    status = next(d.value for d in at.dataframe if "forecast_month_end" in d.value.columns).set_index("team")
    assert status.loc["search", "status"] == "over budget" and status.loc["assistant", "status"] == "no budget"
    assert "**search** is over budget" in _text(at.error)


def test_a_forecast_above_the_budget_warns_before_the_money_is_spent(stack, page):
    today = dt.datetime.now(dt.timezone.utc)
    spent = _report_total(stack, team="search")
    days_in_month = pd.Period(today.date(), "M").days_in_month
    elapsed = (today - today.replace(day=1, hour=0, minute=0, second=0, microsecond=0)).total_seconds() / 86400
    forecast = spent / max(elapsed, 1 / 24) * days_in_month
    if forecast - spent < 1e-6:
        pytest.skip("in the last minutes of a month the forecast equals what was spent")
    budget = (spent + forecast) / 2  # not spent yet, but the run rate will pass it
    with session_scope(stack.db_url) as s:
        from registry.budgets import set_budget
        set_budget(s, "search", round(budget, 6), "USD", actor="test")
    at = page("chargeback")
    assert "**search** will overrun its budget" in _text(at.warning)


def test_a_viewer_sees_budgets_but_no_budget_form(stack, page):
    at = page("chargeback", role="viewer")
    assert not at.exception and not [b for b in at.button if b.label == "Set budget"]
    assert any("forecast_month_end" in d.value.columns for d in at.dataframe)


def test_gpu_hours_by_team_with_the_idle_share(stack, page):
    today = dt.datetime.now(dt.timezone.utc).date()
    store.add_gpu_hours(stack.data_dir / "usage.duckdb", str(today), MODEL, "1", 2.0)
    store.add_gpu_hours(stack.data_dir / "usage.duckdb", str(today), MODEL, "9", 1.0)  # no traffic: idle
    at = page("chargeback")
    hours = next(d.value for d in at.dataframe if "gpu_hours" in d.value.columns).set_index("team")
    assert hours["gpu_hours"].sum() == pytest.approx(3.0) and hours.loc["(idle)", "gpu_hours"] == pytest.approx(1.0)
    assert "Idle share: **33.3%**" in _text(at.caption)


def test_exports_have_period_tier_currency_and_plain_decimals(stack, page):
    at = page("chargeback")
    csv, parquet = (b for b in at.get("download_button"))
    assert csv.proto.label == "Download CSV" and parquet.proto.label == "Download Parquet"
    from admin_ui import chargeback_data as cd
    today = dt.datetime.now(dt.timezone.utc).date()
    lines = cd.export_frame(cd.Filters(today.replace(day=1), today), "USD", stack.data_dir / "usage.duckdb")
    text = cd.to_csv(lines).decode()
    header = text.splitlines()[0].split(",")
    assert header[:2] == ["period", "team"] and {"tier", "currency", "cost_total"} <= set(header)
    assert "e-0" not in text and ",USD" in text
    table = pq.read_table(io.BytesIO(cd.to_parquet(lines)))
    assert str(table.schema.field("cost_total").type) == "decimal128(20, 6)"
    assert float(sum(v.as_py() for v in table.column("cost_total"))) == pytest.approx(_report_total(stack), abs=1e-5)


def test_store_down_chargeback_says_so(stack, page, monkeypatch, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "usage.duckdb").write_bytes(b"this is not a duckdb file" * 100)
    monkeypatch.setenv("FLEET_DATA_DIR", str(broken))
    at = page("chargeback")
    assert not at.exception
    assert "cannot be read" in _text(at.error)
