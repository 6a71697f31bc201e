"""Per-replica report keys in Kubernetes (common/report_key_exchange.py): a GPU pod's `state` sidecar holds no
fleet-wide secret; it trades its pod-bound ServiceAccount token for its own key at a router, which asks the API
server (TokenReview) whose token it is. Checked here: the rendered manifests wire it (projected token with the
exchange's audience, no report-secret in any replica container, routers allowed TokenReview and nothing else),
and over real HTTP (the router's internal app under uvicorn, the API stand-in over TLS) a pod gets only its own
key, and that key cannot make a router accept a report for another replica."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from common.report_channel import REPLICA_HEADER, REPORT_PATH, SIGNATURE_HEADER, replica_key, sign_head
from common.report_key_exchange import AUDIENCE, KEY_PATH, TokenReviewer
from common.settings import load_from_env
from python_backends.engine.state_report import ReplicaSettings
from registry import queries
from registry.db import migrate, session_scope
from router_service.core import Router
from router_service.internal_api import create_internal_app
from router_service.registry_cache import RegistryCache
from tests.deploy import kube_api_standin
from tests.deploy.pod_harness import self_signed as _self_signed
from tests.deploy.test_manifests import OVERLAYS, render

SECRET = b"fleet-wide-report-secret"
POD_A, POD_B = "llm-pool-llama-70b-7d9f-abcde", "llm-pool-llama-70b-7d9f-fghij"
REPLICA_SA = "system:serviceaccount:llm:llm-replica"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_give_replica_pods_a_bound_token_and_routers_only_token_review(overlay) -> None:
    objects = render(overlay)
    deps = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in objects if d["kind"] == "Deployment"}
    pools = {n: p for n, p in deps.items() if n.startswith("llm-pool")}
    assert pools
    for name, pod in pools.items():
        assert pod.get("automountServiceAccountToken") is False, f"{name}: no API token in GPU pods"
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod.get("initContainers", []) + pod["containers"]:
            secret_keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c.get("env", [])
                           if "secretKeyRef" in e.get("valueFrom", {})}
            assert "report-secret" not in secret_keys, f"{name}/{c['name']} holds the fleet-wide report secret"
        # the reporting container: the `state` sidecar (GPU), the engine inside `triton` (cpu-dev)
        state = next(c for c in pod["containers"] if any(e["name"] == "FLEET_REPORT_TOKEN_FILE" for e in c["env"]))
        token_file = Path(next(e["value"] for e in state["env"] if e["name"] == "FLEET_REPORT_TOKEN_FILE"))
        mount = next(m for m in state["volumeMounts"] if m["mountPath"] == str(token_file.parent))
        source = volumes[mount["name"]]["projected"]["sources"][0]["serviceAccountToken"]
        assert (source["audience"], source["path"]) == (AUDIENCE, token_file.name), name
        assert pod["serviceAccountName"] == TokenReviewer("", "").service_account  # what the router accepts
    router = deps["llm-router"]
    assert router["automountServiceAccountToken"] is True  # the TokenReview call's credential
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("ClusterRole", "Role")}
    grants = [rule for b in objects if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
              if any(s["kind"] == "ServiceAccount" and s["name"] == router["serviceAccountName"]
                     and s.get("namespace", "llm") == "llm" for s in b["subjects"])
              for rule in roles[(b["roleRef"]["kind"], b["roleRef"]["name"])]["rules"]]
    assert grants == [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exchange(tmp_path):
    """The router's internal app (real uvicorn) with a TokenReviewer pointed at the API stand-in (TLS)."""
    ca, key = _self_signed(tmp_path)
    (tmp_path / "router-sa-token").write_text("router-sa-token\n")
    api = kube_api_standin.server(0, str(ca), str(key), "router-sa-token", str(tmp_path / "api.jsonl"))
    kube_api_standin.TOKENS.update({
        "token-a": {"username": REPLICA_SA, "pod": POD_A, "audiences": [AUDIENCE]},
        "token-a-api": {"username": REPLICA_SA, "pod": POD_A, "audiences": ["https://kubernetes.default.svc"]},
        "token-ui": {"username": "system:serviceaccount:llm:llm-platform", "pod": "llm-admin-ui-1",
                     "audiences": [AUDIENCE]}})
    threading.Thread(target=api.serve_forever, daemon=True).start()
    db_url = f"sqlite:///{tmp_path / 'registry.sqlite'}"
    migrate(db_url)
    with session_scope(db_url) as s:
        for pod in (POD_A, POD_B):
            queries.upsert_replica(s, pod, model="llama-70b", version="1", region="region-a", state="serving", pid=0,
                                   grpc_url="10.0.0.1:8001", http_url="", metrics_url="")
    reviewer = TokenReviewer(f"https://127.0.0.1:{api.server_address[1]}", "llm",
                             token_file=tmp_path / "router-sa-token", ca_file=ca)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_internal_app(Router(RegistryCache(db_url)), SECRET, reviewer),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", tmp_path
    server.should_exit = True
    thread.join(10)
    api.shutdown()
    api.server_close()
    kube_api_standin.TOKENS.clear()


def _report(replica_id: str) -> bytes:
    return json.dumps({"replica_id": replica_id, "model": "llama-70b", "version": "1", "kv_blocks_total": 10,
                       "kv_blocks_free": 10, "block_size": 16, "full_snapshot": True, "prefix_hashes": [],
                       "draining": True}).encode()


def _post_report(url: str, replica_id: str, key: str) -> httpx.Response:
    body = _report(replica_id)
    return httpx.post(url + REPORT_PATH, content=body, timeout=5, headers={
        "content-type": "application/json", REPLICA_HEADER: replica_id,
        SIGNATURE_HEADER: sign_head(key, replica_id, body)})


def test_a_pod_gets_only_its_own_key_and_cannot_forge_another_replicas_report(exchange, monkeypatch) -> None:
    url, folder = exchange
    (folder / "token").write_text("token-a\n")
    monkeypatch.setenv("FLEET_REPLICA_ID", POD_A)
    monkeypatch.setenv("FLEET_ROUTER_URLS", url)
    monkeypatch.setenv("FLEET_REPORT_TOKEN_FILE", str(folder / "token"))
    identity = load_from_env(ReplicaSettings).identity()  # what the state sidecar does at start
    key_a = identity["report_key"]
    assert key_a == replica_key(SECRET, POD_A)
    assert _post_report(url, POD_A, key_a).status_code == 200  # its own reports are accepted
    forged = _post_report(url, POD_B, key_a)  # pod A speaking for pod B with the only key it has
    assert forged.status_code == 401 and "does not match" in forged.json()["error"]["message"]
    # a sidecar that claims another pod's name than its token's stops at start, naming the field
    monkeypatch.setenv("FLEET_REPLICA_ID", POD_B)
    with pytest.raises(ValueError, match="FLEET_REPLICA_ID"):
        load_from_env(ReplicaSettings).identity()


@pytest.mark.parametrize("authorization, why", [
    (None, "Bearer"), ("Bearer token-b-made-up", "not authenticated"),
    ("Bearer token-a-api", "not authenticated"),  # a token for the API server's audience, not the exchange's
    ("Bearer token-ui", "only 'system:serviceaccount:llm:llm-replica'")])
def test_tokens_the_api_server_does_not_vouch_for_as_a_replica_pod_get_no_key(exchange, authorization, why) -> None:
    url, _ = exchange
    headers = {"authorization": authorization} if authorization else {}
    answer = httpx.post(url + KEY_PATH, json={}, headers=headers, timeout=10)
    assert answer.status_code == 401 and why in answer.json()["error"]["message"], answer.text
    assert "report_key" not in answer.text
