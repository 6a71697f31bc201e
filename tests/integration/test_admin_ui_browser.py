"""The admin UI end to end: `fleet up` (the whole platform, UI and metrics scraper included), real requests
from two teams in three tiers (one through a LoRA adapter), a budget set through the admin API, then headless
Chromium: every page renders without an exception or error box, the chargeback total for a filtered deep link
equals `fleet usage report` for the same filters, the budget overrun warning shows, an API key's budget set in
the chargeback page's form is audited and enforced by the router (that key's next request gets the budget
error), a reload keeps the session, and a viewer sees no write control. Screenshots go to
docs/img/admin-<page>.png (docs/admin_ui.md)."""
from __future__ import annotations

import datetime as dt
import json
import time

import httpx
import pytest

from common.processes import wait_until
from common.settings import REPO_ROOT
from registry import queries
from registry.db import session_scope
from tests.admin_ui.browser import KeyBudget, tour_admin_ui
from tests.integration.platform import Platform

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
SHOTS = REPO_ROOT / "docs" / "img"
PROMPTS = ["What is the capital of France?", "Name three primary colours.", "Say hello in Spanish."]
TIERS = ("interactive", "standard", "batch")
KEY_BUDGET = KeyBudget("ui-key-budget-svc", 10, unit="tokens", period="day")  # below any request's prompt + max_tokens


def _second_team_key(p: Platform) -> str:
    """A caller of another team, added to the platform's registry (the router reloads it within a second)."""
    with session_scope(p.env.get("FLEET_DB_URL", f"sqlite:///{p.data_dir / 'registry.sqlite'}")) as s:
        return queries.create_caller(s, "search-svc", "search")


def _key_of_the_dev_team(p: Platform, name: str) -> str:
    """A caller in the dev key's team (no team budget there), for the budget the tour sets on it alone."""
    with session_scope(p.env.get("FLEET_DB_URL", f"sqlite:///{p.data_dir / 'registry.sqlite'}")) as s:
        return queries.create_caller(s, name, queries.caller_by_key(s, p.api_key).team)


def _complete(p: Platform, key: str, prompt: str, tier: str, stream: bool, adapter: str = "") -> None:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": stream, "priority": tier,
            "adapter": adapter, "messages": [{"role": "user", "content": prompt}]}
    headers = {"authorization": f"Bearer {key}"}
    if stream:
        with httpx.stream("POST", f"{p.http_url}/v1/chat/completions", json=body, headers=headers,
                          timeout=180) as resp:
            assert resp.status_code == 200, resp.read()
            assert "[DONE]" in "".join(resp.iter_text())
    else:
        resp = httpx.post(f"{p.http_url}/v1/chat/completions", json=body, headers=headers, timeout=180)
        assert resp.status_code == 200, resp.text


def _usage_rows(p: Platform) -> int:
    from usage.store import connect
    with connect(p.data_dir / "usage.duckdb", read_only=True) as con:
        return con.execute("SELECT count(*) FROM usage_events").fetchone()[0]


def _report_total(p: Platform, since: dt.date, until: dt.date, **filters: str) -> float:
    args = ["usage", "report", "--view", "cost", "--by", "team", "--format", "json", "--since", str(since),
            "--until", str(until + dt.timedelta(days=1))] + [f"--{k}={v}" for k, v in filters.items()]
    out = p.fleet(*args, timeout=120)
    assert out.returncode == 0, out.stderr
    return round(sum(r["cost_total"] for r in json.loads(out.stdout)), 6)


def test_every_admin_page_renders_with_real_data(platform):
    """Uses the session's shared platform (tests/integration/conftest.py)."""
    p = platform
    rows_before = _usage_rows(p)
    search_key = _second_team_key(p)
    budget_key = _key_of_the_dev_team(p, KEY_BUDGET.caller)
    for key in (search_key, budget_key):
        wait_until(lambda k=key: httpx.get(f"{p.http_url}/v1/models", headers={"authorization": f"Bearer {k}"},
                                           timeout=5).status_code == 200, 30, "the router knows the new caller's key")
    _complete(p, budget_key, PROMPTS[1], "standard", stream=False)  # within budget: the key itself may serve
    sent = 1
    for i, prompt in enumerate(PROMPTS):
        for key in (p.api_key, search_key):
            for tier in TIERS:
                _complete(p, key, prompt, tier, stream=bool((i + len(tier)) % 2))
                sent += 1
    _complete(p, p.api_key, PROMPTS[0], "standard", stream=True, adapter="french")
    sent += 1
    admin = {"authorization": f"Bearer {p.admin_token}"}
    # an operator change, so the audit log shows one made through the admin API
    resp = httpx.post(f"{p.http_url}/admin/models/{MODEL}/rollout", json={"version": "1", "percent": 100},
                      headers=admin, timeout=30)
    assert resp.status_code == 200, resp.text
    # a budget far below what search spends: the chargeback page must warn
    resp = httpx.put(f"{p.http_url}/admin/budgets/search", json={"monthly_amount": 0.000001}, headers=admin,
                     timeout=30)
    assert resp.status_code == 200, resp.text
    # keep one replica warm: the warm-buffer page then shows the target and what it costs per day
    resp = httpx.put(f"{p.http_url}/admin/warm-buffers/{MODEL}/1", headers=admin, timeout=30, json={
        "min_idle_replicas": 1, "min_replicas": 1, "max_replicas": 2, "slo_ttft_ms_p95": 3000, "slo_tokens_per_s": 10})
    assert resp.status_code == 200, resp.text
    wait_until(lambda: _usage_rows(p) >= rows_before + sent, 120, "every usage event in the store", interval_s=1)
    time.sleep(2 * float(p.env["FLEET_METRICS_SCRAPE_S"]) + 1)  # at least one scrape after the traffic

    today = dt.datetime.now(dt.timezone.utc).date()
    first = today.replace(day=1)
    ui = f"http://127.0.0.1:{p.env['FLEET_ADMIN_UI_PORT']}"
    viewer_token = (p.data_dir / "viewer-token").read_text().strip()
    tour = tour_admin_ui(ui, p.admin_token, viewer_token, SHOTS, timeout_s=180,
                         deep_link=f"/chargeback?team=search&tier=batch&since={first}&until={today}",
                         key_budget=KEY_BUDGET)
    assert [r.name for r in tour.reports] == ["login", "fleet", "rollouts", "buffers", "chargeback", "capacity"]
    for r in [*tour.reports, tour.deep_link, *tour.viewer]:
        assert not r.exceptions, f"{r.name}: Streamlit exception {r.exceptions}"
        errors = [e for e in r.errors if "over budget" not in e]
        assert not errors, f"{r.name}: error shown {errors}"
    for r in tour.reports:
        assert r.screenshot.stat().st_size > 20_000, f"{r.name}: screenshot looks empty"

    chargeback = tour.reports[4]
    total = float(chargeback.metrics["cost (USD)"].replace(",", ""))
    assert total == pytest.approx(_report_total(p, first, today), abs=1e-6)
    assert any("search" in e and "over budget" in e for e in chargeback.errors), chargeback.errors
    filtered = float(tour.deep_link.metrics["cost (USD)"].replace(",", ""))
    assert filtered > 0 and filtered == pytest.approx(_report_total(p, first, today, team="search", tier="batch"),
                                                      abs=1e-6)
    assert tour.deep_link.metrics["requests"] == str(len(PROMPTS)), "the deep link's filters were applied"

    fleet = tour.reports[1]
    assert fleet.metrics["TTFT p95, last 5 min"].endswith("ms"), fleet.metrics
    assert tour.reload_kept_session, "a browser reload signed the user out"
    assert [r.write_controls for r in tour.viewer] == [0, 0, 0, 0], "a viewer must see no write controls"
    assert tour.reports[2].write_controls > 0 and chargeback.write_controls > 0, "the operator does see them"

    # the key budget set in the chargeback page's form: audited by the admin API, enforced by the router
    assert f"{KEY_BUDGET.caller}: budget set to 10 tokens per day" in tour.key_budget_message, tour.key_budget_message
    audit = httpx.get(f"{p.http_url}/admin/audit", params={"limit": 200}, headers=admin, timeout=30).json()["entries"]
    assert any(e["action"] == "set_key_budget" and e["target"] == KEY_BUDGET.caller and e["after"]["unit"] == "tokens"
               for e in audit), "the UI's write went through the audited admin API"
    refused = httpx.post(f"{p.http_url}/v1/chat/completions", headers={"authorization": f"Bearer {budget_key}"},
                         timeout=60, json={"model": MODEL, "max_tokens": 12, "priority": "standard",
                                           "messages": [{"role": "user", "content": PROMPTS[1]}]})
    assert refused.status_code == 429, refused.text
    assert f"budget exhausted: key '{KEY_BUDGET.caller}'" in refused.json()["error"]["message"], refused.text
