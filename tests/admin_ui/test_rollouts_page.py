"""Models & rollouts page: only allowed choices, old -> new preview with confirmation, the router's own refusal,
no audit row for a no-op, promote / rollback, automatic rollback rules, audit, roles."""
from __future__ import annotations

import pytest

from admin_ui.router_client import AdminApiError, RouterClient
from registry import queries
from registry.db import session_scope
from registry.queries import split_problems
from tests.admin_ui.stack import MODEL, OPERATOR_TOKEN, VIEWER_TOKEN


def _routes(db_url: str) -> dict[str, int]:
    with session_scope(db_url) as s:
        return queries.routes_for(s, MODEL)


def _audit(db_url: str) -> list:
    with session_scope(db_url) as s:
        return [(a.actor, a.action, a.target, a.after) for a in queries.list_audit(s, 100)]


def _errors(at) -> str:
    return " | ".join(e.value for e in at.error)


def _stage(db_url: str, version: str, status: str) -> None:
    with session_scope(db_url) as s:
        queries.set_model_status(s, MODEL, version, status)


def test_rollout_to_30_percent_previews_then_changes_the_route_after_confirming(stack, page):
    at = page("rollouts")
    assert not at.exception
    at.selectbox(key="percent_version").select("2").run()
    at.slider(key="percent_slider").set_value(30).run()
    preview = at.dataframe[1].value.set_index("version")
    assert preview.loc["1"].tolist() == [100, 70] and preview.loc["2"].tolist() == [0, 30], "old -> new shown"
    at.button(key="apply_percent").click().run()
    assert _routes(stack.db_url) == {"1": 100}, "nothing changes before the confirmation"
    at.button(key="confirm_percent").click().run()
    assert not at.exception, at.exception
    assert _errors(at) == ""
    assert _routes(stack.db_url) == {"1": 70, "2": 30}
    newest = _audit(stack.db_url)[0]
    assert newest[:3] == ("alice", "set_routes", MODEL) and newest[3] == {"routes": {"1": 70, "2": 30}}
    assert any("30 %" in s.value for s in at.success), "the page confirms the change"
    audit = at.dataframe[-1].value
    assert "set_routes" in audit["action"].tolist(), "the audit table shows the change"
    assert "v1 100 % → 70 %, v2 0 % → 30 %" in audit["change"].tolist() and audit["at (UTC)"].str.endswith(" UTC").all()


def test_only_routable_versions_are_offered_and_one_version_offers_no_split(stack, page):
    _stage(stack.db_url, "2", "built")  # built, not staged: the registry would refuse traffic to it
    at = page("rollouts")
    assert not at.exception
    assert "percent_slider" not in [s.key for s in at.slider] and "apply_split" not in [b.key for b in at.button]
    assert "no split to change" in " | ".join(i.value for i in at.info)
    assert at.selectbox(key="promote_version").options == ["1"]


def test_the_router_refuses_with_its_own_message_as_a_400_not_a_500(stack):
    client = RouterClient(f"http://127.0.0.1:{stack.port}", OPERATOR_TOKEN)
    with pytest.raises(AdminApiError) as err:
        client.set_percent(MODEL, "1", 50)  # v1 alone: nobody can take the other 50 %
    assert err.value.status == 400 and "no other routed version can take the remaining 50 %" in err.value.message


def test_setting_the_same_split_again_writes_no_audit_row(stack, page):
    client = RouterClient(f"http://127.0.0.1:{stack.port}", OPERATOR_TOKEN)
    before = _audit(stack.db_url)
    assert client.set_split(MODEL, {"1": 100}) == {"1": 100}
    assert _audit(stack.db_url) == before
    at = page("rollouts")
    at.number_input(key=f"split_{MODEL}_1").set_value(100)
    at.number_input(key=f"split_{MODEL}_2").set_value(0).run()
    assert "nothing to apply" in " | ".join(i.value for i in at.info) and "apply_split" not in [b.key for b in at.button]


@pytest.mark.parametrize("split, problem", [({"1": 50, "2": 20}, "sum to 70"),
                                            ({"1": 60, "2": 60}, "sum to 120")])
def test_an_invalid_split_shows_the_error_and_changes_nothing(stack, page, split, problem):
    at = page("rollouts")
    audit_before = _audit(stack.db_url)
    for version, percent in split.items():
        at.number_input(key=f"split_{MODEL}_{version}").set_value(percent)
    at.run()
    assert not at.exception
    assert problem in _errors(at) and "Not possible" in _errors(at)
    assert "apply_split" not in [b.key for b in at.button], "an invalid split cannot be applied"
    assert _routes(stack.db_url) == {"1": 100}
    assert _audit(stack.db_url) == audit_before


def test_unknown_versions_are_refused_by_the_page_and_by_the_router(stack):
    """The page checks a split before sending it; the router checks again (one validated write path)."""
    assert any("no version '7'" in p for p in split_problems({"1": 90, "7": 10}, ["1", "2"]))
    assert split_problems({"1": 70, "2": 30}, ["1", "2"]) == []
    with pytest.raises(AdminApiError) as err:
        RouterClient(f"http://127.0.0.1:{stack.port}", OPERATOR_TOKEN).set_split(MODEL, {"1": 90, "7": 10})
    assert err.value.status == 400 and "no version '7'" in err.value.message
    assert _routes(stack.db_url) == {"1": 100}


def test_promote_and_rollback_wait_for_confirmation(stack, page):
    at = page("rollouts")
    at.selectbox(key="promote_version").select("2").run()
    at.button(key="promote").click().run()
    assert _routes(stack.db_url) == {"1": 100}, "nothing changes before the confirm step"
    assert any("v2" in w.value for w in at.warning)
    at.button(key="confirm_promote").click().run()
    assert not at.exception and _errors(at) == ""
    assert _routes(stack.db_url) == {"2": 100}
    at.button(key="rollback").click().run()
    assert _routes(stack.db_url) == {"2": 100}
    at.button(key="cancel_rollback").click().run()
    assert _routes(stack.db_url) == {"2": 100} and "confirm_rollback" not in [b.key for b in at.button]
    at.button(key="rollback").click().run()
    at.button(key="confirm_rollback").click().run()
    assert _routes(stack.db_url) == {"1": 100}
    assert [a[1] for a in _audit(stack.db_url)[:2]] == ["rollback", "set_routes"]


def test_a_viewer_sees_no_write_controls_and_the_api_refuses_its_writes(stack, page):
    at = page("rollouts", role="viewer")
    assert not at.exception
    keys = {w.key for w in [*at.button, *at.slider, *at.number_input]}
    assert not keys & {"apply_percent", "percent_slider", "apply_split", "promote", "rollback"}
    assert len(at.dataframe) >= 2, "a viewer still reads versions, comparison and audit"
    with pytest.raises(AdminApiError) as err:
        RouterClient(f"http://127.0.0.1:{stack.port}", VIEWER_TOKEN).set_percent(MODEL, "2", 30)
    assert err.value.status == 403 and "operator" in err.value.message
    assert _routes(stack.db_url) == {"1": 100}


def test_versions_build_info_and_side_by_side_comparison(stack, page):
    at = page("rollouts")
    versions = at.dataframe[0].value
    assert set(versions["version"]) == {"1", "2"} and "abc123" in versions["build_info"].iloc[0]
    comparison = next(d.value for d in at.dataframe if "ttft_ms_p95" in d.value.columns)
    assert list(comparison["version"]) == ["1", "2"]
    v1, v2 = comparison.set_index("version").loc["1"], comparison.set_index("version").loc["2"]
    assert v2["ttft_ms_p95"] > v1["ttft_ms_p95"] and v2["error_rate"] > 0 == v1["error_rate"]
    assert len(at.get("plotly_chart")) == 2, "versions over time (three panels) and the comparison chart"


def test_operator_arms_an_automatic_rollback_rule(stack, page):
    at = page("rollouts")
    at.selectbox(key="rule_version").select("2")
    at.number_input(key="rule_error").set_value(10.0)
    at.number_input(key="rule_ttft").set_value(1500)
    at.number_input(key="rule_minutes").set_value(2)
    next(b for b in at.button if b.label == "Save rule").click().run()
    assert not at.exception and _errors(at) == ""
    rules = RouterClient(f"http://127.0.0.1:{stack.port}", VIEWER_TOKEN).rollback_rules()
    assert [(r["version"], r["max_error_rate"], r["max_ttft_ms_p95"], r["minutes"], r["armed"]) for r in rules] == \
        [("2", 0.1, 1500.0, 2, True)]
    assert _audit(stack.db_url)[0][:3] == ("alice", "set_rollback_rule", f"{MODEL}/2")
