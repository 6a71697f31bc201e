"""A team budget enforced at admission on the running platform (`fleet up`: router, replica, Kafka, loader):
a team five requests short of its hard budget sends 64 requests at once; five are admitted (the soft share
warns), the rest get the budget error naming the budget, period and reset; spend after settlement stays within
the budget; and the chargeback page's numbers, `fleet usage report` and the routers' spend agree.
(Two routers sharing one budget row: tests/router/test_router_tier.py, on SQLite and PostgreSQL.)"""
from __future__ import annotations

import concurrent.futures
import datetime as dt
import json

import httpx
import pytest

from common.processes import wait_until
from registry import budgets, queries
from registry.db import session_scope

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
TEAM, CALLER = "budget-team", "budget-caller"
MAX_TOKENS = 8


def _db_url(platform) -> str:
    return platform.env.get("FLEET_DB_URL") or f"sqlite:///{platform.data_dir / 'registry.sqlite'}"


def _complete(platform, key: str, i: int) -> httpx.Response:
    with httpx.Client(timeout=120) as client:
        return client.post(f"{platform.http_url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": f"Budget request {i}: the capital of France is",
                                 "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def _admin(platform, method: str, path: str, body: dict | None = None) -> dict:
    resp = httpx.request(method, f"{platform.http_url}/admin{path}", json=body, timeout=10,
                         headers={"authorization": f"Bearer {platform.admin_token}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _routers_spend(platform) -> dict:
    return next(b for b in _admin(platform, "GET", "/budgets")["budgets"] if b["team"] == TEAM)


def test_a_team_short_of_its_budget_is_stopped_at_it_and_every_report_agrees(platform):
    db_url = _db_url(platform)
    with session_scope(db_url) as s:
        queries.ensure_team(s, TEAM)
        key = queries.create_caller(s, CALLER, TEAM)
        queries.bump_version(s)
    _admin(platform, "PUT", f"/budgets/{TEAM}", {"monthly_amount": 10**9, "unit": "tokens", "period": "day"})
    wait_until(lambda: _complete(platform, key, 0).status_code == 200, 30, "the new caller to be known")
    first = _routers_spend(platform)
    per_request = int(first["spent"])            # prompt + 8 completion tokens, settled
    assert per_request > MAX_TOKENS and first["reserved"] == 0

    # five requests short: every request needs (and uses) exactly its worst case, prompt + max_tokens
    amount = per_request + 5 * per_request
    _admin(platform, "PUT", f"/budgets/{TEAM}", {"monthly_amount": amount, "unit": "tokens", "period": "day",
                                                 "soft_share": 0.8})   # the admin API reloads its router at once
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: _complete(platform, key, 1 + i % 9), range(64)))
    ok = [r for r in answers if r.status_code == 200]
    refused = [r.json()["error"]["message"] for r in answers if r.status_code == 429]
    assert len(ok) == 5 and len(refused) == 59, [r.status_code for r in answers]
    period = budgets.period_key("day")
    reset = budgets.resets_at("day").isoformat()
    assert all(f"budget exhausted: team '{TEAM}'" in m and period in m and f"resets at {reset}" in m
               for m in refused), refused[:2]
    assert any("budget_warning" in r.json() for r in ok)          # past the soft share
    spend = _routers_spend(platform)
    assert spend["reserved"] == 0 and spend["spent"] <= amount
    later = _complete(platform, key, 99)
    assert later.status_code == 429 and "budget exhausted" in later.json()["error"]["message"]
    assert int(later.headers["retry-after"]) > 0

    # chargeback page numbers, `fleet usage report` and the routers' spend: the same six requests
    def report() -> list[dict]:
        out = platform.fleet("usage", "report", "--team", TEAM, "--by", "team", "--format", "json", timeout=120)
        rows = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
        return rows if rows and rows[0]["requests"] == 6 else []
    rows = wait_until(report, 120, "the team's six usage events in DuckDB")
    tokens = rows[0]["prefill_tokens"] + rows[0]["cached_tokens"] + rows[0]["decode_tokens"]
    assert tokens == spend["spent"] == 6 * per_request
    from admin_ui import chargeback_data
    page = chargeback_data.budget_status(dt.datetime.now(dt.timezone.utc), "USD",
                                         path=platform.data_dir / "usage.duckdb", db_url=db_url).set_index("team")
    assert page.loc[TEAM, "month_to_date"] == pytest.approx(rows[0]["cost_total"], abs=1e-6)
    assert page.loc[TEAM, "routers_spent"] == spend["spent"] and page.loc[TEAM, "unit"] == "tokens"

