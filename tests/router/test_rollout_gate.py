"""The promotion rule of the admin API against a real registry (SQLite and PostgreSQL): a version may take more
than the gated percentage only with a passed quality gate; an operator's override is explicit and audited;
lowering a share (and rollback) is never refused; the rollout view shows the versions' gate reports side by side."""
import pytest
from fastapi.testclient import TestClient

from registry import queries
from registry.admin_tokens import set_admin_token
from registry.db import session_scope
from router_service.core import Router
from router_service.http_frontend import create_app
from router_service.registry_cache import RegistryCache
from router_service.rollout import ramp_gate_problems
from tests.admin_ui.gate_reports import gate_report

OPERATOR, VIEWER = "op-token", "view-token"
AUTH, VIEW = {"authorization": f"Bearer {OPERATOR}"}, {"authorization": f"Bearer {VIEWER}"}


@pytest.fixture
def client(db_url, seeded):
    """m/1 serving with a passed gate; m/2 failed its gate (agreement 0.5); m/3 has no report (registered by
    hand, or built before the gate existed)."""
    def extra(s):
        queries.upsert_model_version(s, "m", "2", quality_gate=gate_report(0.5))
        queries.upsert_model_version(s, "m", "3", status="staged", max_context=2048)
        set_admin_token(s, "alice", "operator", OPERATOR)
        set_admin_token(s, "victor", "viewer", VIEWER)
    seeded(db_url, versions=("1", "2"), extra=extra)
    router = Router(RegistryCache(db_url))
    router.rollout_gate_percent = 10
    return TestClient(create_app(router)), db_url


def _routes(db_url):
    with session_scope(db_url) as s:
        return queries.routes_for(s, "m")


def test_ramp_past_the_gated_percentage_needs_a_passed_gate(client):
    http, db_url = client
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 10}, headers=AUTH)
    assert r.status_code == 200 and _routes(db_url) == {"1": 90, "2": 10}  # up to the limit: allowed
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 30}, headers=AUTH)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400
    assert "version '2' has no passed quality gate (greedy agreement 0.5000 < 0.9)" in msg
    assert "at most 10 %" in msg and "override_quality_gate" in msg
    r = http.post("/admin/models/m/rollout", json={"split": {"1": 50, "3": 50}}, headers=AUTH)
    assert r.status_code == 400 and "version '3' has no passed quality gate (no quality-gate report" in \
        r.json()["error"]["message"]
    r = http.post("/admin/models/m/promote", json={"version": "2"}, headers=AUTH)
    assert r.status_code == 400 and "asked 100 %" in r.json()["error"]["message"]
    assert _routes(db_url) == {"1": 90, "2": 10}  # nothing changed
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 0}, headers=AUTH)
    assert r.status_code == 200 and _routes(db_url) == {"1": 100}  # lowering is never refused
    r = http.post("/admin/models/m/rollout", json={"version": "1", "percent": 100}, headers=AUTH)
    assert r.status_code == 200  # the passed version keeps (or takes) everything


def test_operator_override_is_explicit_and_audited(client):
    http, db_url = client
    r = http.post("/admin/models/m/rollout", headers=AUTH,
                  json={"version": "2", "percent": 50, "override_quality_gate": "short"})
    assert r.status_code == 400 and "override_quality_gate" in r.json()["error"]["message"]
    reason = "INC-7: gate reference OOM on the build node; evals passed offline"
    r = http.post("/admin/models/m/rollout", headers=AUTH,
                  json={"version": "2", "percent": 50, "override_quality_gate": reason})
    assert r.status_code == 200 and _routes(db_url) == {"1": 50, "2": 50}
    audit = http.get("/admin/audit", headers=VIEW).json()["entries"]
    assert [e["action"] for e in audit[:2]] == ["set_routes", "quality_gate_override"]
    override = audit[1]
    assert override["actor"] == "alice" and override["target"] == "m"
    assert override["after"]["reason"] == reason and override["after"]["gate_percent"] == 10
    assert "greedy agreement 0.5000 < 0.9" in override["after"]["problems"][0]
    assert audit[0]["after"]["quality_gate_override"]["reason"] == reason
    r = http.post("/admin/models/m/rollback", headers=AUTH)  # rolling back needs no gate
    assert r.status_code == 200 and _routes(db_url) == {"1": 100}


def test_rollout_view_shows_gate_reports_side_by_side(client):
    http, _ = client
    http.post("/admin/models/m/rollout", json={"version": "2", "percent": 10}, headers=AUTH)
    view = http.get("/admin/models/m/rollout", headers=VIEW).json()["quality_gate"]
    assert view["gate_percent"] == 10
    serving, candidate, manual = view["versions"]["1"], view["versions"]["2"], view["versions"]["3"]
    assert serving["passed"] is True and serving["metrics"]["agreement"] == 0.97
    assert candidate["passed"] is False and candidate["metrics"]["agreement"] == 0.5
    assert candidate["thresholds"]["min_agreement"] == 0.9 and len(candidate["eval_set_sha256"]) == 64
    assert manual == {"passed": False, "missing": True,
                      "failures": ["no quality-gate report (not built by build-engines with the gate)"]}


def test_rule_itself():
    passed, failed = {"passed": True}, {"passed": False, "failures": ["x"]}
    assert ramp_gate_problems({"1": 100}, {"1": 80, "2": 20}, {"1": passed, "2": passed}, 10) == []
    assert ramp_gate_problems({"1": 100}, {"1": 90, "2": 10}, {"1": passed, "2": failed}, 10) == []
    assert ramp_gate_problems({"1": 100}, {"1": 89, "2": 11}, {"1": passed, "2": failed}, 10) != []
    # a version already above the limit that does not grow is not refused (an ungated legacy version)
    assert ramp_gate_problems({"1": 60, "2": 40}, {"1": 70, "2": 30}, {"1": failed, "2": passed}, 10) != []
    assert ramp_gate_problems({"1": 80, "2": 20}, {"1": 70, "2": 30}, {"1": failed, "2": passed}, 10) == []
