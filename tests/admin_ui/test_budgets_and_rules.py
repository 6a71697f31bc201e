"""Budgets and automatic rollback rules: the admin API (validated, audited, viewer read-only, no audit row
for a no-op) and the rollback evaluator on real usage events in the store and a real registry."""
from __future__ import annotations

import time
import uuid

import httpx
import pandas as pd
import pytest

from registry import queries, rollback_rules
from registry.db import session_scope
from tests.admin_ui.stack import MODEL, OPERATOR_TOKEN, VIEWER_TOKEN
from usage import auto_rollback, store


def _api(stack, method: str, path: str, token: str = OPERATOR_TOKEN, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, f"http://127.0.0.1:{stack.port}/admin{path}", json=body, timeout=10,
                         headers={"authorization": f"Bearer {token}"})


def _audit(db_url: str) -> list:
    with session_scope(db_url) as s:
        return [(a.actor, a.action, a.target, a.before, a.after) for a in queries.list_audit(s, 100)]


def test_budget_is_set_audited_once_and_read_by_viewers(stack):
    resp = _api(stack, "PUT", "/budgets/search", body={"monthly_amount": 120.5})
    assert resp.status_code == 200 and resp.json()["changed"] is True and resp.json()["currency"] == "USD"
    assert _audit(stack.db_url)[0] == ("alice", "set_budget", "search", None,
                                       {"monthly_amount": 120.5, "currency": "USD", "period": "month",
                                        "unit": "money", "soft_share": 0.8, "enforce": True})
    again = _api(stack, "PUT", "/budgets/search", body={"monthly_amount": 120.5})
    assert again.json()["changed"] is False and len([a for a in _audit(stack.db_url) if a[1] == "set_budget"]) == 1
    listed = _api(stack, "GET", "/budgets", token=VIEWER_TOKEN).json()
    assert listed["currency"] == "USD" and [b["team"] for b in listed["budgets"]] == ["search"]
    assert listed["budgets"][0]["spent"] == 0.0 and listed["budgets"][0]["reserved"] == 0.0
    daily = _api(stack, "PUT", "/budgets/search", body={"monthly_amount": 50000, "period": "day", "unit": "tokens",
                                                         "soft_share": 0.5, "enforce": False})
    assert daily.json() | {"changed": None} == {"team": "search", "monthly_amount": 50000, "currency": "USD",
                                                "period": "day", "unit": "tokens", "soft_share": 0.5,
                                                "enforce": False, "changed": None}
    assert _audit(stack.db_url)[0][3]["period"] == "month" and _audit(stack.db_url)[0][4]["period"] == "day"


def test_caller_limits_and_team_weights_are_set_audited_and_bounded(stack):
    with session_scope(stack.db_url) as s:
        caller = queries.list_callers(s)[0].name
    ok = _api(stack, "PUT", f"/callers/{caller}/limits", body={"requests_per_s": 5, "tokens_per_minute": 1000})
    assert ok.status_code == 200 and ok.json()["changed"] is True
    assert _audit(stack.db_url)[0][1:3] == ("set_caller_limits", caller)
    assert "requests_per_s" in _api(stack, "PUT", f"/callers/{caller}/limits",
                                    body={"requests_per_s": 0.5}).json()["error"]["message"]
    assert _api(stack, "PUT", "/teams/search/weight", body={"weight": 3}).json()["fair_weight"] == 3.0
    assert _api(stack, "PUT", "/teams/search/weight", body={"weight": 0}).status_code == 400
    assert _api(stack, "PUT", "/teams/search/weight", token=VIEWER_TOKEN, body={"weight": 2}).status_code == 403


@pytest.mark.parametrize("team, body, status, words", [
    ("nobody", {"monthly_amount": 10}, 400, "team 'nobody' is not registered; known teams: ['assistant', 'search']"),
    ("search", {"monthly_amount": -1}, 400, "monthly_amount"),
    ("search", {"monthly_amount": 10, "extra": 1}, 400, "extra"),
    ("search", {"monthly_amount": 10, "period": "week"}, 400, "period"),
    ("search", {"monthly_amount": 10, "soft_share": 1.5}, 400, "soft_share"),
])
def test_bad_budgets_are_refused_with_the_field_named(stack, team, body, status, words):
    resp = _api(stack, "PUT", f"/budgets/{team}", body=body)
    assert resp.status_code == status and words in resp.json()["error"]["message"]
    assert not [a for a in _audit(stack.db_url) if a[1] == "set_budget"]


def test_a_viewer_cannot_set_budgets_or_rules(stack):
    assert _api(stack, "PUT", "/budgets/search", VIEWER_TOKEN, {"monthly_amount": 1}).status_code == 403
    assert _api(stack, "PUT", f"/rollback-rules/{MODEL}/2", VIEWER_TOKEN, {"max_error_rate": 0.1}).status_code == 403


def test_a_rule_needs_a_threshold_and_a_known_version(stack):
    none = _api(stack, "PUT", f"/rollback-rules/{MODEL}/2", body={"minutes": 3})
    assert none.status_code == 400 and "max_error_rate (0..1) or max_ttft_ms_p95" in none.json()["error"]["message"]
    unknown = _api(stack, "PUT", f"/rollback-rules/{MODEL}/9", body={"max_error_rate": 0.1})
    assert unknown.status_code == 400 and "has no version '9'" in unknown.json()["error"]["message"]


def _events(path, version: str, minutes: int, now: float, error_every: int, ttft_ms: float) -> None:
    """Real usage events (through usage.store) for the last `minutes` whole minutes, 4 per minute."""
    end = int(now // 60) * 60
    rows = []
    for m in range(minutes):
        for i in range(4):
            rows.append({"request_id": f"r-{uuid.uuid4().hex}", "ts": end - (m + 1) * 60 + 5 + i * 10,
                         "caller": "chat-svc", "team": "assistant", "model": MODEL, "version": version,
                         "adapter": "", "priority": "interactive", "region": "local", "replica_id": "r0",
                         "prompt_tokens": 20, "cached_prompt_tokens": 0, "completion_tokens": 8, "ttft_ms": ttft_ms,
                         "duration_ms": ttft_ms + 200, "finish_reason": "length",
                         "status": "error" if error_every and i % error_every == 0 else "ok"})
    with store.connect(path) as con:
        store.insert_events(con, pd.DataFrame(rows, columns=store.EVENT_COLUMNS))


def _arm(stack, **rule) -> None:
    resp = _api(stack, "PUT", f"/rollback-rules/{MODEL}/2", body=rule)
    assert resp.status_code == 200, resp.text


def test_an_armed_rule_rolls_a_failing_version_back_and_audits_why(stack):
    with session_scope(stack.db_url) as s:
        queries.set_routes(s, MODEL, {"1": 80, "2": 20}, actor="test")
    _arm(stack, max_error_rate=0.2, minutes=3)
    now = time.time()
    _events(stack.data_dir / "usage.duckdb", "2", 3, now, error_every=2, ttft_ms=300)  # 50 % errors
    fired = auto_rollback.evaluate(stack.data_dir / "usage.duckdb", stack.db_url, now=now)
    assert len(fired) == 1
    with session_scope(stack.db_url) as s:
        assert queries.routes_for(s, MODEL) == {"1": 100}
        rule = rollback_rules.get_rule(s, MODEL, "2")
        assert not rule.armed and "error rate 50.0%, 50.0%, 50.0% (limit 20.0%)" in rule.fired_reason
    actor, action, target, before, after = _audit(stack.db_url)[0]
    assert (actor, action, target) == ("auto-rollback", "auto_rollback", MODEL)
    assert before == {"routes": {"1": 80, "2": 20}} and after["routes"] == {"1": 100} and "error rate" in after["reason"]
    assert auto_rollback.evaluate(stack.data_dir / "usage.duckdb", stack.db_url, now=now) == [], "disarmed"


def test_a_rule_does_not_fire_on_a_healthy_or_quiet_version(stack):
    with session_scope(stack.db_url) as s:
        queries.set_routes(s, MODEL, {"1": 80, "2": 20}, actor="test")
    _arm(stack, max_error_rate=0.2, max_ttft_ms_p95=1000, minutes=3)
    now = time.time()
    _events(stack.data_dir / "usage.duckdb", "2", 2, now, error_every=2, ttft_ms=5000)  # bad, but only 2 minutes
    assert auto_rollback.evaluate(stack.data_dir / "usage.duckdb", stack.db_url, now=now) == []
    later = now + 60 * 10
    _events(stack.data_dir / "usage.duckdb", "2", 3, later, error_every=0, ttft_ms=200)  # healthy minutes
    assert auto_rollback.evaluate(stack.data_dir / "usage.duckdb", stack.db_url, now=later) == []
    with session_scope(stack.db_url) as s:
        assert queries.routes_for(s, MODEL) == {"1": 80, "2": 20} and rollback_rules.get_rule(s, MODEL, "2").armed
