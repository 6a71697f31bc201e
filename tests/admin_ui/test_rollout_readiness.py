"""Models & rollouts page says what traffic each version gets now: a version without a ready replica
keeps its share pending, from the router's own readiness view (real router app over a real registry)."""
from __future__ import annotations

from admin_ui.router_client import RouterClient
from tests.admin_ui.stack import MODEL, OPERATOR_TOKEN


def _traffic_line(at) -> str:
    return next(m.value for m in at.markdown if m.value.startswith("**Traffic now:**"))


def test_rollout_page_shows_pending_share_until_the_version_has_a_ready_replica(stack, page):
    client = RouterClient(f"http://127.0.0.1:{stack.port}", OPERATOR_TOKEN)
    client.replica_action(f"{MODEL}-v2-r2", "cordon")  # v2's only replica leaves service
    client.set_percent(MODEL, "2", 30)
    status = client.rollout(MODEL)["rollout"]
    assert status["effective"] == {"1": 100.0} and status["versions"][1]["pending_percent"] == 30.0
    line = _traffic_line(page("rollouts"))
    assert "v2: 0 of 1 replicas ready, 30 % pending" in line
    assert "v1: 2 replicas ready, carrying 100 % (configured 70 %)" in line
    client.replica_action(f"{MODEL}-v2-r2", "uncordon")
    assert client.rollout(MODEL)["rollout"]["effective"] == {"1": 70.0, "2": 30.0}
    assert "v2: 1 of 1 replicas ready, 30 %" in _traffic_line(page("rollouts"))
