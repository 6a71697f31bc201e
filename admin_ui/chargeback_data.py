"""The chargeback page's numbers: cost over time, breakdowns, unit cost, budgets vs actual with a month-end
forecast, each API key's own budget against the routers' spend, the budget editor's input check, GPU-hours,
and the export file. All cost comes from usage.chargeback (one pricing definition),
so the page's totals are the `fleet usage report` totals for the same filters.

Dates are UTC days; the page's range is inclusive of its last day (chargeback's `until` is exclusive).
"""
from __future__ import annotations

import calendar
import datetime as dt
import io
import math
from dataclasses import dataclass, field
from decimal import Decimal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from admin_ui.usage_data import store_path
from common.settings import load_settings
from registry import budgets
from registry.db import session_scope
from registry.queries import list_callers
from usage import chargeback, store

FILTER_DIMENSIONS = ("team", "model", "version", "adapter", "tier", "caller")
TOKEN_COLUMNS = ["prefill_tokens", "cached_tokens", "decode_tokens"]
EXPORT_DIMENSIONS = ("day", "team", "caller", "model", "version", "adapter", "tier")
MONEY_DECIMALS = 6


@dataclass(frozen=True)
class Filters:
    since: dt.date
    until: dt.date  # inclusive
    equal: dict[str, str] = field(default_factory=dict)  # dimension -> value; '' adapter = the base model

    @property
    def until_exclusive(self) -> dt.date:
        return self.until + dt.timedelta(days=1)


def money(amount: float) -> str:
    """An amount as people read it: 2 decimals from 1 up, 6 below (token prices make tiny amounts)."""
    return f"{amount:,.2f}" if abs(amount) >= 1 else f"{amount:.6f}"


def month_to_date(today: dt.date) -> tuple[dt.date, dt.date]:
    return today.replace(day=1), today


def options(since: dt.date, until: dt.date, path=None) -> dict[str, list[str]]:
    """The values each filter can take in the range (only values with usage)."""
    where, params = chargeback.where_clause(since, until + dt.timedelta(days=1), {})
    out = {}
    with store.connect(store_path(path), read_only=True) as con:
        for dim in FILTER_DIMENSIONS:
            col = chargeback.DIMENSIONS[dim]
            out[dim] = [r[0] for r in con.execute(f"SELECT DISTINCT {col} FROM usage_rollups WHERE {where} "
                                                  f"ORDER BY 1", params).fetchall()]
    return out


def cost(f: Filters, group_by: tuple[str, ...], path=None) -> pd.DataFrame:
    return chargeback.cost_table(store_path(path), f.since, f.until_exclusive, group_by=group_by, filters=f.equal)


def cost_over_time(f: Filters, path=None) -> pd.DataFrame:
    """Cost per day and team, with every day of the range present (0 where nothing ran)."""
    got = cost(f, ("day", "team"), path)
    days = pd.date_range(f.since, f.until, freq="D").date
    teams = sorted(got["team"].unique()) if not got.empty else []
    grid = pd.MultiIndex.from_product([days, teams], names=["day", "team"])
    if got.empty:
        return pd.DataFrame(columns=["day", "team", "cost_total", "requests"])
    frame = got.set_index(["day", "team"])[["cost_total", "requests"]].reindex(grid, fill_value=0).reset_index()
    frame["day"] = pd.to_datetime(frame["day"])
    return frame


def unit_costs(f: Filters, path=None) -> pd.DataFrame:
    """Cost per 1M tokens (all kinds) by team and model."""
    got = cost(f, ("team", "model"), path)
    tokens = got[TOKEN_COLUMNS].sum(axis=1)
    got["tokens"] = tokens
    got["cost_per_1m_tokens"] = (got["cost_total"] / tokens.where(tokens > 0) * 1e6).round(MONEY_DECIMALS)
    return got[["team", "model", "requests", "tokens", "cost_total", "cost_per_1m_tokens"]]


def budget_rows(db_url: str | None = None) -> dict[str, tuple[float, str]]:
    """team -> (amount per period, currency) from the registry."""
    return {team: (b["monthly_amount"], b["currency"]) for team, b in budget_details(db_url).items()}


def budget_details(db_url: str | None = None) -> dict[str, dict]:
    """team -> the budget (amount, currency, period, unit, soft share, enforce) and what the routers counted in
    its current period: `spent` (settled requests, priced by the same rates) and `reserved` (in flight)."""
    with session_scope(db_url or load_settings().db_url) as s:
        spend = budgets.spend_rows(s)
        return {b.team: {**budgets.budget_dict(b), **spend.get(b.team, {})} for b in budgets.list_budgets(s)}


def budget_status(now: dt.datetime, currency: str, path=None, db_url: str | None = None) -> pd.DataFrame:
    """Per team with a budget or usage this month: month-to-date cost, a month-end forecast at the
    month-to-date run rate, the budget and a status (on track / will overrun / over budget / no budget)."""
    first = now.date().replace(day=1)
    days_in_month = calendar.monthrange(now.year, now.month)[1]
    month_start = dt.datetime.combine(first, dt.time(), tzinfo=dt.timezone.utc)
    elapsed = max((now - month_start).total_seconds() / 86400, 1 / 24)  # at least an hour: no wild early forecast
    mtd = chargeback.cost_table(store_path(path), first, now.date() + dt.timedelta(days=1), group_by=("team",))
    actual = dict(zip(mtd["team"], mtd["cost_total"])) if not mtd.empty else {}
    rows = []
    details = budget_details(db_url)
    for team in sorted(set(actual) | set(details)):
        b = details.get(team, {})
        amount, budget_currency = b.get("monthly_amount"), b.get("currency", currency)
        spent = float(actual.get(team, 0.0))
        forecast = spent / elapsed * days_in_month
        if amount is None:
            status = "no budget"
        elif b["period"] != "month" or b["unit"] != "money":
            status = f"{b['period']}ly budget in {b['unit']}: see the routers' spend".replace("dayly", "daily")
        elif budget_currency != currency:
            status = f"budget is in {budget_currency}, prices in {currency}: not compared"
        elif spent > amount:
            status = "over budget"
        elif forecast > amount:
            status = "will overrun"
        else:
            status = "on track"
        rows.append({"team": team, "month_to_date": round(spent, MONEY_DECIMALS),
                     "forecast_month_end": round(forecast, MONEY_DECIMALS), "budget": amount,
                     "used_share": spent / amount if amount else None, "status": status,
                     "period": b.get("period"), "unit": b.get("unit"), "routers_spent": b.get("spent"),
                     "routers_reserved": b.get("reserved")})
    return pd.DataFrame(rows, columns=["team", "month_to_date", "forecast_month_end", "budget", "used_share",
                                       "status", "period", "unit", "routers_spent", "routers_reserved"]
                        ).sort_values("team").reset_index(drop=True)


KEY_BUDGET_COLUMNS = ["caller", "team", "budget", "unit", "period", "current_period", "spent", "reserved",
                      "used_share", "soft_share", "enforce", "status"]


def callers(db_url: str | None = None) -> dict[str, str]:
    """Every registered caller (API key) -> its team, by name."""
    with session_scope(db_url or load_settings().db_url) as s:
        return {c.name: c.team for c in sorted(list_callers(s), key=lambda c: c.name)}


def key_budget_status(currency: str, db_url: str | None = None) -> pd.DataFrame:
    """Per caller with a budget of its own: the budget and what the routers counted against it in its current
    period: `spent` (settled requests) and `reserved` (worst case of those in flight), the very rows admission
    checks (registry/quotas.py refuses a request when spent + reserved + its worst case passes the budget)."""
    with session_scope(db_url or load_settings().db_url) as s:
        spend = budgets.spend_rows(s, scope=budgets.KEY)
        teams = {c.name: c.team for c in list_callers(s)}
        rows = []
        for b in budgets.list_budgets(s, budgets.KEY):
            d, used = budgets.budget_dict(b), spend.get(b.caller, {})
            spent, reserved = used.get("spent", 0.0), used.get("reserved", 0.0)
            share = (spent + reserved) / d["monthly_amount"] if d["monthly_amount"] else None
            rows.append({"caller": b.caller, "team": teams.get(b.caller, ""), "budget": d["monthly_amount"],
                         "unit": d["unit"] if d["unit"] == "tokens" else d["currency"], "period": d["period"],
                         "current_period": used.get("current_period"), "spent": spent, "reserved": reserved,
                         "used_share": share, "soft_share": d["soft_share"], "enforce": d["enforce"],
                         "status": _key_status(d, spent + reserved, currency)})
    return pd.DataFrame(rows, columns=KEY_BUDGET_COLUMNS)


def _key_status(b: dict, committed: float, currency: str) -> str:
    note = f" (budget in {b['currency']}, prices in {currency})" if b["unit"] == "money" and \
        b["currency"] != currency else ""
    if committed >= b["monthly_amount"]:
        return ("over budget: requests refused" if b["enforce"] else "over budget (not enforced)") + note
    if committed >= b["soft_share"] * b["monthly_amount"]:
        return "past the warning share: callers are warned" + note
    return "within budget" + note


def budget_input_problems(owner_label: str, owner: str | None, amount: float, unit: str,
                          soft_share: float) -> dict[str, str]:
    """Field -> why the budget editor's input is refused and what is allowed, before anything is sent (the
    router checks the same bounds again: registry/budgets.py budget_problem)."""
    problems = {}
    if not owner:
        problems["owner"] = f"{owner_label}: choose one; the budget belongs to it"
    if not isinstance(amount, (int, float)) or not math.isfinite(amount) or \
            not 0 <= amount <= budgets.MAX_MONTHLY_AMOUNT:
        problems["amount"] = (f"Budget per period is {amount!r}; allowed 0 to {budgets.MAX_MONTHLY_AMOUNT:,.0f} "
                              "(0 refuses every request while enforced)")
    elif unit == "tokens" and amount != int(amount):
        problems["amount"] = f"Budget per period is {amount:g} tokens; a token budget is a whole number of tokens"
    if unit not in budgets.UNITS:
        problems["unit"] = f"Unit is {unit!r}; allowed {', '.join(budgets.UNITS)}"
    if not isinstance(soft_share, (int, float)) or not 0 < soft_share <= 1:
        problems["soft_share"] = (f"Warn at share is {soft_share!r}; allowed above 0 up to 1 (0.8 warns callers "
                                  "from 80 % of the budget)")
    return problems


def gpu_hours(f: Filters, path=None) -> pd.DataFrame:
    """GPU-hours by team over the range (the days and team filters; GPU time has no tier or caller), idle hours
    as team '(idle)' and always listed, so the fleet's idle share stays visible when one team is chosen."""
    every = chargeback.gpu_hours_by_team(store_path(path), f.since, f.until_exclusive)
    team = f.equal.get("team")
    return every if team is None else every[every["team"].isin([team, chargeback.IDLE_TEAM])].reset_index(drop=True)


def export_frame(f: Filters, currency: str, path=None) -> pd.DataFrame:
    """One row per day, team, caller, model, version, adapter and tier: the chargeback line items."""
    got = cost(f, EXPORT_DIMENSIONS, path).sort_values(list(EXPORT_DIMENSIONS)).reset_index(drop=True)
    got.insert(0, "period", got.pop("day").astype(str))
    got["currency"] = currency
    return got


def to_csv(frame: pd.DataFrame) -> bytes:
    """CSV with plain decimals (0.000003, never 3e-06)."""
    return frame.to_csv(index=False, float_format=f"%.{MONEY_DECIMALS}f").encode()


def to_parquet(frame: pd.DataFrame) -> bytes:
    """Parquet with money as decimal(20, 6) (exact, as finance tools expect) and counts as int64."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    for i, name in enumerate(table.column_names):
        if name.startswith("cost_"):
            table = table.set_column(i, name, pa.array(
                [None if pd.isna(v) else Decimal(f"{float(v):.{MONEY_DECIMALS}f}") for v in frame[name]],
                type=pa.decimal128(20, MONEY_DECIMALS)))
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()
