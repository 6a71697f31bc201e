"""Login, Fleet, Warm buffers, Chargeback and Capacity pages driven by streamlit's AppTest, plus what the
pages do when the router or the usage store is down."""
from __future__ import annotations

import httpx
import pytest
from streamlit.testing.v1 import AppTest

from common.processes import free_port
from common.settings import REPO_ROOT
from registry.db import session_scope
from registry.warm_buffers import get_warm_buffer
from tests.admin_ui.stack import MODEL, OPERATOR_TOKEN, VIEWER_TOKEN


def _text(elements) -> str:
    return " | ".join(str(e.value) for e in elements)


# --- login -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, role", [(OPERATOR_TOKEN, "operator"), (VIEWER_TOKEN, "viewer")])
def test_login_stores_the_role_of_the_token(stack, token, role):
    at = AppTest.from_file(str(REPO_ROOT / "admin_ui" / "app.py"), default_timeout=60).run()
    assert not at.exception and at.text_input(key="login_token")
    at.text_input(key="login_token").input(token)
    at.button[0].click().run()
    assert not at.exception, at.exception
    assert at.session_state["role"] == role and at.session_state["token"] == token


def test_login_refuses_an_unknown_token(stack):
    at = AppTest.from_file(str(REPO_ROOT / "admin_ui" / "app.py"), default_timeout=60).run()
    at.text_input(key="login_token").input("not-a-token")
    at.button[0].click().run()
    assert "refused" in _text(at.error) and "role" not in at.session_state


def test_login_while_the_router_is_down_uses_the_token_files(stack, monkeypatch):
    monkeypatch.setenv("FLEET_ROUTER_HTTP_PORT", str(free_port()))
    at = AppTest.from_file(str(REPO_ROOT / "admin_ui" / "app.py"), default_timeout=60).run()
    at.text_input(key="login_token").input(VIEWER_TOKEN)
    at.button[0].click().run()
    assert not at.exception and at.session_state["role"] == "viewer"
    at = AppTest.from_file(str(REPO_ROOT / "admin_ui" / "app.py"), default_timeout=60).run()
    at.text_input(key="login_token").input("not-a-token")
    at.button[0].click().run()
    assert "cannot be reached" in _text(at.error) and "role" not in at.session_state


def test_pages_ask_for_login_first(stack, page):
    at = page("fleet", role=None)
    assert "Sign in first" in _text(at.warning) and not at.dataframe


# --- fleet -------------------------------------------------------------------------------------------------

def test_fleet_shows_replicas_kv_queue_ttft_against_slo(stack, page):
    at = page("fleet")
    assert not at.exception, at.exception
    rollup, replicas = at.dataframe[0].value, at.dataframe[1].value
    assert rollup[["serving"]].sum().item() == 3 and set(rollup["version"]) == {"1", "2"}
    assert len(replicas) == 3 and replicas["reporting"].all()
    first = replicas.sort_values("replica_id").iloc[0]
    assert first["kv_utilisation"] == pytest.approx(100 / 512)
    assert list(replicas.sort_values("ttft_ms_p95")["meets_slo"]) == [True, True, False]  # 250, 450, 650 vs 500
    assert {m.label: m.value for m in at.metric}["serving"] == "3"
    assert len(at.get("plotly_chart")) == 2
    assert "No metrics history yet" in _text(at.info), "no scrape yet: the page says where history comes from"


def test_fleet_lists_each_routers_own_view_with_admitted_per_s_from_the_scraper(stack, page):
    """One router here (its /metrics on the HTTP port, as `fleet up` with one router): up, what it has in
    flight and queued now, and its admitted/s between the scraper's two newest scrapes."""
    import time
    from router_service import metrics
    from usage.metrics_scraper import scrape_once
    url, path, now = f"http://127.0.0.1:{stack.port}", stack.data_dir / "usage.duckdb", time.time()
    scrape_once(url, path, 86400, now=now - 20)
    for _ in range(30):
        metrics.REQUESTS.labels(MODEL, "standard", "ok", "stop").inc()
    scrape_once(url, path, 86400, now=now - 10)
    at = page("fleet")
    assert not at.exception, at.exception
    routers = at.dataframe[-1].value
    assert routers["router"].tolist() == [0] and routers["up"].tolist() == [True]
    assert routers["url"].iloc[0] == url and routers["inflight"].iloc[0] >= 0 and routers["queued"].iloc[0] >= 0
    assert routers["admitted_per_s"].iloc[0] == pytest.approx(3.0)     # 30 requests in 10 s
    assert "1 of 1 up" in _text(at.markdown)


def test_operator_cordons_a_replica_only_after_confirming(stack, page):
    at = page("fleet")
    rid = sorted(r.replica_id for r in stack.router.registry.snapshot.replicas)[0]
    at.selectbox(key="replica_pick").select(rid)
    at.selectbox(key="replica_action_pick").select("cordon")
    at.button(key="replica_apply").click().run()
    assert not at.exception and "cordon" in _text(at.warning)
    assert at.dataframe[1].value.set_index("replica_id").loc[rid, "state"] == "serving", "one click changes nothing"
    at.button(key="replica_confirm").click().run()
    assert not at.exception and not at.error
    replicas = at.dataframe[1].value.set_index("replica_id")
    assert replicas.loc[rid, "state"] == "cordoned"


def test_viewer_sees_fleet_without_replica_actions(stack, page):
    at = page("fleet", role="viewer")
    assert not at.exception and len(at.dataframe) == 3
    assert not [s for s in at.selectbox if s.key in ("replica_pick", "replica_action_pick")]


def test_router_down_the_fleet_page_says_so_and_shows_registered_replicas(stack, page, monkeypatch):
    monkeypatch.setenv("FLEET_ROUTER_HTTP_PORT", str(free_port()))
    at = page("fleet")
    assert not at.exception
    assert "Router down" in _text(at.error)
    assert len(at.dataframe[1].value) == 3, "registered replicas are still listed"
    routers = at.dataframe[-1].value
    assert routers["up"].tolist() == [False] and "ConnectError" in routers["error"].iloc[0]


def test_router_down_rollouts_reads_the_audit_log_from_the_registry(stack, page, monkeypatch):
    monkeypatch.setenv("FLEET_ROUTER_HTTP_PORT", str(free_port()))
    at = page("rollouts")
    assert not at.exception and "Router down" in _text(at.error)
    assert "set_routes" in at.dataframe[-1].value["action"].tolist()


# --- warm buffers ------------------------------------------------------------------------------------------

def _buffer(db_url: str, version: str = "1"):
    with session_scope(db_url) as s:
        row = get_warm_buffer(s, MODEL, version)
        return None if row is None else (row.min_idle_replicas, row.min_replicas, row.max_replicas,
                                         row.slo_ttft_ms_p95, row.slo_tokens_per_s)


def test_min_greater_than_max_shows_the_problem_next_to_the_field_and_writes_nothing(stack, page):
    at = page("buffers")
    before = _buffer(stack.db_url)
    at.selectbox(key="buffer_target").select(f"{MODEL}/1").run()
    at.number_input(key="wb_min_replicas").set_value(5)
    at.number_input(key="wb_max_replicas").set_value(2)
    at.number_input(key="wb_min_idle_replicas").set_value(-1)
    at.button[0].click().run()
    errors = _text(at.error)
    assert "min_replicas (5) is greater than max_replicas (2)" in errors or "must be 0 or more" in errors
    at.number_input(key="wb_min_idle_replicas").set_value(0)
    at.button[0].click().run()
    assert "min_replicas (5) is greater than max_replicas (2)" in _text(at.error)
    assert _buffer(stack.db_url) == before


def test_saving_a_warm_buffer_goes_through_the_router(stack, page):
    at = page("buffers")
    at.selectbox(key="buffer_target").select(f"{MODEL}/2").run()
    at.number_input(key="wb_min_idle_replicas").set_value(1)
    at.number_input(key="wb_max_replicas").set_value(4)
    at.button[0].click().run()
    assert not at.exception
    probe = httpx.put(f"http://127.0.0.1:{stack.port}/admin/warm-buffers/x/y", json={}, timeout=10)
    has_endpoint = probe.status_code != 404  # once the route exists it answers 400/401, never 404
    if has_endpoint:
        assert _buffer(stack.db_url, "2") == (1, 1, 4, 500, 40)
    else:  # the router does not have the endpoint yet: the page says so and nothing is written
        assert "no warm-buffer endpoint" in _text(at.error) and _buffer(stack.db_url, "2") is None


def test_viewer_sees_buffers_and_decisions_but_no_form(stack, page):
    at = page("buffers", role="viewer")
    assert not at.exception and len(at.dataframe) == 2 and not at.number_input
    assert "No scaling decisions recorded yet" in _text(at.info)


# --- capacity ----------------------------------------------------------------------------------------------

def test_capacity_simulates_a_policy(stack, page):
    at = page("capacity")
    assert "Simulate" in _text(at.info)
    at.selectbox(key="cap_policy").select("static")
    at.select_slider(key="cap_horizon").set_value(1)
    at.select_slider(key="cap_step").set_value(120)
    at.button[0].click().run(timeout=120)
    assert not at.exception, at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert int(metrics["peak GPUs"].replace(",", "")) > 0 and metrics["interactive SLO met"].endswith("%")
    assert len(at.get("plotly_chart")) == 3
