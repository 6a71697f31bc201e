"""Per-key (per caller) budgets on the chargeback page, driven by AppTest on a real registry and router HTTP app:
an operator sets and removes a key's budget through the admin API (audited as set_key_budget /
delete_key_budget, the same editor as the team budgets), bad input is refused naming the field and what is
allowed, the table shows the routers' spend against the budget, and a viewer gets the table but no form."""
from __future__ import annotations

import httpx

from registry import budgets, queries
from registry.db import session_scope
from tests.admin_ui.stack import OPERATOR_TOKEN


def _text(elements) -> str:
    return " | ".join(str(e.value) for e in elements)


def _audit(db_url: str, n: int = 5) -> list[tuple]:
    with session_scope(db_url) as s:
        return [(a.actor, a.action, a.target, a.after) for a in queries.list_audit(s, n)]


def _button(at, label: str):
    return next(b for b in at.button if b.label == label)


def _key_table(at):
    return next(d.value for d in at.dataframe if "current_period" in d.value.columns).set_index("caller")


def _set_key_budget(at, caller: str, amount: float, unit: str = "money", period: str = "month"):
    at.selectbox(key="key_budget_caller").select(caller)
    at.number_input(key="key_budget_amount").set_value(amount)
    at.selectbox(key="key_budget_unit").select(unit)
    at.selectbox(key="key_budget_period").select(period)
    return _button(at, "Set key budget").click().run()


def test_operator_sets_and_removes_a_key_budget_through_the_audited_api(stack, page):
    at = page("chargeback")
    assert "No API key has a budget of its own" in _text(at.info)
    assert not [b for b in at.button if b.label == "Remove key budget"], "nothing to remove yet"
    _set_key_budget(at, "search-svc", 5000, unit="tokens", period="day")
    assert not at.exception and "Not changed" not in _text(at.error), _text(at.error)
    assert "caller (api key) search-svc: budget set to 5,000 tokens per day" in _text(at.success)
    assert _audit(stack.db_url)[0] == ("alice", "set_key_budget", "search-svc", {
        "monthly_amount": 5000.0, "currency": "USD", "period": "day", "unit": "tokens", "soft_share": 0.8,
        "enforce": True})
    row = _key_table(at).loc["search-svc"]
    assert (row["team"], row["budget"], row["unit"], row["period"], row["spent"], row["status"]) == \
        ("search", 5000.0, "tokens", "day", 0.0, "within budget")
    listed = httpx.get(f"http://127.0.0.1:{stack.port}/admin/budgets", timeout=10,
                       headers={"authorization": f"Bearer {OPERATOR_TOKEN}"}).json()
    assert [(k["caller"], k["monthly_amount"]) for k in listed["key_budgets"]] == [("search-svc", 5000.0)]

    at.selectbox(key="key_budget_remove_owner").select("search-svc")
    _button(at, "Remove key budget").click().run()
    assert not at.exception and "Not changed" not in _text(at.error), _text(at.error)
    assert _audit(stack.db_url)[0][:3] == ("alice", "delete_key_budget", "search-svc")
    assert "No API key has a budget of its own" in _text(at.info)


def test_bad_key_budget_input_names_the_field_and_what_is_allowed(stack, page):
    at = page("chargeback")
    _set_key_budget(at, "chat-svc", 12.5, unit="tokens")
    assert "Not changed: Budget per period is 12.5 tokens; a token budget is a whole number of tokens" \
        in _text(at.error)
    assert not [a for a in _audit(stack.db_url) if a[1] == "set_key_budget"], "nothing was sent"


def test_the_table_shows_the_routers_spend_and_an_exhausted_key(stack, page):
    with session_scope(stack.db_url) as s:
        budgets.set_budget(s, "chat-svc", 0.5, "USD", actor="test", scope=budgets.KEY)
        budgets.add_spend(s, "chat-svc", budgets.period_key("month"), 0.6, budgets.KEY)
    at = page("chargeback")
    row = _key_table(at).loc["chat-svc"]
    assert row["spent"] == 0.6 and row["used_share"] == 1.2 and row["unit"] == "USD"
    assert row["status"] == "over budget: requests refused"
    assert "Key **chat-svc** (team assistant) is over budget: 0.6 of 0.5 USD" in _text(at.error)


def test_a_viewer_sees_key_budgets_but_no_key_budget_form(stack, page):
    with session_scope(stack.db_url) as s:
        budgets.set_budget(s, "search-svc", 10, "USD", actor="test", scope=budgets.KEY)
    at = page("chargeback", role="viewer")
    assert not at.exception and "search-svc" in _key_table(at).index
    assert not {"Set key budget", "Remove key budget", "Remove budget"} & {b.label for b in at.button}


def test_the_same_editor_removes_a_team_budget(stack, page):
    with session_scope(stack.db_url) as s:
        budgets.set_budget(s, "search", 100, "USD", actor="test")
    at = page("chargeback")
    at.selectbox(key="budget_remove_owner").select("search")
    _button(at, "Remove budget").click().run()
    assert not at.exception and "Not changed" not in _text(at.error), _text(at.error)
    assert _audit(stack.db_url)[0][:3] == ("alice", "delete_budget", "search")
    assert "team search: budget removed" in _text(at.success)
