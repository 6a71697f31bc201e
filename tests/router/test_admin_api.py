"""Admin API against a real registry (SQLite and PostgreSQL): roles, rollout, rollback, audit."""
import pytest
from fastapi.testclient import TestClient

from registry import queries
from registry.db import session_scope
from registry.admin_tokens import set_admin_token
from router_service.core import Router
from router_service.http_frontend import create_app
from router_service.registry_cache import BudgetInfo, RegistryCache

OPERATOR, VIEWER = "op-token", "view-token"


@pytest.fixture
def client(db_url, seeded):
    seeded(db_url, versions=("1", "2"), replicas=[("m-r0", "local")], extra=lambda s: (
        set_admin_token(s, "alice", "operator", OPERATOR), set_admin_token(s, "victor", "viewer", VIEWER)))
    router = Router(RegistryCache(db_url))
    return TestClient(create_app(router)), db_url


def _auth(token):
    return {"authorization": f"Bearer {token}"}


def test_rollout_rollback_and_audit(client):
    http, db_url = client
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 30}, headers=_auth(OPERATOR))
    assert r.status_code == 200 and r.json()["routes"] == {"1": 70, "2": 30}
    with session_scope(db_url) as s:
        assert queries.routes_for(s, "m") == {"1": 70, "2": 30}
    r = http.post("/admin/models/m/rollback", headers=_auth(OPERATOR))
    assert r.json()["routes"] == {"1": 100}
    with session_scope(db_url) as s:
        assert queries.routes_for(s, "m") == {"1": 100}
    audit = http.get("/admin/audit", headers=_auth(VIEWER)).json()["entries"]
    assert [e["action"] for e in audit[:2]] == ["rollback", "set_routes"]


def test_viewer_cannot_write_and_bad_splits_change_nothing(client):
    http, db_url = client
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 30}, headers=_auth(VIEWER))
    assert r.status_code == 403 and "operator" in r.json()["error"]["message"]
    assert http.get("/admin/fleet", headers=_auth("nope")).status_code == 401
    r = http.post("/admin/models/m/rollout", json={"split": {"1": 50, "2": 20}}, headers=_auth(OPERATOR))
    assert r.status_code == 400 and "sum to 70" in r.json()["error"]["message"]
    r = http.post("/admin/models/m/rollout", json={"version": "7", "percent": 10}, headers=_auth(OPERATOR))
    assert r.status_code == 400 and "no version '7'" in r.json()["error"]["message"]
    r = http.post("/admin/models/m/rollout", json={"version": "2", "percent": 130}, headers=_auth(OPERATOR))
    assert r.status_code == 400 and "percent" in r.json()["error"]["message"]
    with session_scope(db_url) as s:
        assert queries.routes_for(s, "m") == {"1": 100}


def test_cordon_and_fleet_view(client):
    http, _ = client
    assert http.post("/admin/replicas/m-r0/cordon", headers=_auth(OPERATOR)).json()["state"] == "cordoned"
    fleet = http.get("/admin/fleet", headers=_auth(VIEWER)).json()
    assert fleet["replicas"][0]["state"] == "cordoned" and fleet["routes"] == {"m": {"1": 100}}
    r = http.post("/admin/replicas/m-r0/explode", headers=_auth(OPERATOR))
    assert r.status_code == 404 and "cordon, drain, uncordon" in r.json()["error"]["message"]


def test_registry_changes_reach_a_watching_router_within_one_second(sqlite_url, seeded):
    """A second router (its own RegistryCache) sees an admin change made elsewhere within 1 s."""
    import asyncio
    import time

    seeded(sqlite_url, versions=("1", "2"))
    cache = RegistryCache(sqlite_url)

    async def main():
        watcher = asyncio.create_task(cache.watch())
        await asyncio.sleep(0.1)
        with session_scope(sqlite_url) as s:
            queries.set_routes(s, "m", {"2": 100}, actor="other-router")
        changed = time.monotonic()
        while cache.snapshot.routes.get("m") != {"2": 100} and time.monotonic() - changed < 2:
            await asyncio.sleep(0.02)
        watcher.cancel()
        return time.monotonic() - changed
    assert asyncio.run(main()) < 1.0


def test_a_keys_own_budget_is_set_listed_audited_and_deleted(client):
    http, db_url = client
    caller = "search-svc"
    with session_scope(db_url) as s:
        queries.create_caller(s, caller, "search", api_key="k-search")
    body = {"monthly_amount": 5000, "period": "day", "unit": "tokens", "soft_share": 0.5}
    r = http.put(f"/admin/callers/{caller}/budget", json=body, headers=_auth(OPERATOR))
    assert r.status_code == 200 and r.json()["caller"] == caller and r.json()["changed"] is True
    assert http.put(f"/admin/callers/{caller}/budget", json=body, headers=_auth(OPERATOR)).json()["changed"] is False
    # every router's snapshot carries it with the caller (what QuotaLedger.admit_caller reserves against)
    assert RegistryCache(db_url).caller_for_key("k-search").budget == BudgetInfo(caller, 5000, "day", "tokens", 0.5,
                                                                                   True)
    audit = http.get("/admin/audit", headers=_auth(VIEWER)).json()["entries"]
    assert [(e["action"], e["target"]) for e in audit if "budget" in e["action"]] == [("set_key_budget", caller)]
    listed = http.get("/admin/budgets", headers=_auth(VIEWER)).json()
    assert [(b["caller"], b["monthly_amount"], b["unit"], b["spent"], b["reserved"]) for b in listed["key_budgets"]] \
        == [(caller, 5000, "tokens", 0.0, 0.0)] and listed["budgets"] == []
    bad = http.put("/admin/callers/nobody/budget", json=body, headers=_auth(OPERATOR))
    assert bad.status_code == 400 and "caller (API key) 'nobody' is not registered" in bad.json()["error"]["message"]
    neg = http.put(f"/admin/callers/{caller}/budget", json={"monthly_amount": -1}, headers=_auth(OPERATOR))
    assert neg.status_code == 400 and "monthly_amount" in neg.json()["error"]["message"]
    assert http.put(f"/admin/callers/{caller}/budget", json=body, headers=_auth(VIEWER)).status_code == 403
    assert http.delete(f"/admin/callers/{caller}/budget", headers=_auth(OPERATOR)).json()["deleted"] is True
    assert http.delete(f"/admin/callers/{caller}/budget", headers=_auth(OPERATOR)).status_code == 404
    audit = http.get("/admin/audit", headers=_auth(VIEWER)).json()["entries"]
    assert audit[0]["action"] == "delete_key_budget" and audit[0]["before"]["monthly_amount"] == 5000
