"""Issue 12, holes 6, 7 and 8 on the real router: what a key may see (gRPC metadata RPCs, /v1/models, error
messages, staged canaries, adapters' base version and status), the concurrency cap and quotas that survive a
router restart, and named, hashed admin tokens whose names the audit log records."""
from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb

from common.settings import REPO_ROOT
from registry import queries
from registry.schema import Adapter, AdminToken, Caller
from tests.security.conftest import MODEL, bearer, registry_write

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world(stack):
    """A second model, a staged 0 % canary, a restricted caller, a canary tester, another team's adapter."""
    def setup(s):
        queries.upsert_model_version(s, "secret-model", "1", status="serving", max_context=2048)
        queries.set_routes(s, "secret-model", {"1": 100}, actor="test")
        base = queries.get_model_version(s, MODEL, "1")
        queries.upsert_model_version(s, MODEL, "2", status="staged", max_context=2048, weights_uri=base.weights_uri)
        keys = {"narrow": queries.create_caller(s, "narrow", "dev-team"),
                "tester": queries.create_caller(s, "tester", "qa-team", canary_access=True),
                "other": queries.create_caller(s, "other", "other-team")}
        s.flush()
        s.get(Caller, "narrow").allowed_models = [MODEL]
        queries.ensure_team(s, "other-team")
        s.add(Adapter(name="other-secret", base_model=MODEL, base_version="1", uri="/x", rank=8,
                      owner_team="other-team", status="ready"))
        s.add(Adapter(name="broken", base_model=MODEL, base_version="1", uri="/x", rank=8, owner_team="dev-team",
                      status="failed"))
        s.add(Adapter(name="for-v2", base_model=MODEL, base_version="2", uri="/x", rank=8, owner_team="dev-team",
                      status="ready"))
        return keys
    return registry_write(stack, setup)


def _meta(key: str | None):
    return (("authorization", f"Bearer {key}"),) if key else ()


def test_grpc_metadata_rpcs_need_a_key_and_show_only_allowed_models(stack, kserve, world):
    for call, req in ((kserve.ModelMetadata, pb.ModelMetadataRequest(name=MODEL)),
                      (kserve.RepositoryIndex, pb.RepositoryIndexRequest()),
                      (kserve.ModelReady, pb.ModelReadyRequest(name=MODEL))):
        with pytest.raises(grpc.RpcError) as info:  # before: answered without a key
            call(req, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    index = kserve.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=_meta(world["narrow"]), timeout=10)
    assert {m.name for m in index.models} == {MODEL} and {m.version for m in index.models} == {"1"}
    assert not kserve.ModelReady(pb.ModelReadyRequest(name="secret-model"), metadata=_meta(world["narrow"])).ready
    with pytest.raises(grpc.RpcError) as info:
        kserve.ModelMetadata(pb.ModelMetadataRequest(name="nope"), metadata=_meta(world["narrow"]), timeout=10)
    assert "secret-model" not in info.value.details()
    tester = kserve.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=_meta(world["tester"]), timeout=10)
    assert {(m.name, m.version) for m in tester.models} >= {(MODEL, "2"), ("secret-model", "1")}


def test_models_listing_and_errors_leak_nothing(stack, http, world):
    listing = http.get("/v1/models", headers=bearer(world["narrow"])).json()
    assert [m["id"] for m in listing["data"]] == [MODEL] and listing["data"][0]["versions"] == ["1"]
    r = http.post("/v1/completions", headers=bearer(world["narrow"]), json={"model": "nope", "prompt": "Hi"})
    assert r.status_code == 404 and "secret-model" not in r.text  # before: listed every model
    r = http.post("/v1/completions", headers=bearer(world["narrow"]), json={"model": "secret-model", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("model:")
    r = http.post("/v1/completions", headers=bearer(stack.api_key), json={"model": MODEL, "prompt": "Hi",
                                                                          "adapter": "nope"})
    assert r.status_code == 404 and "other-secret" not in r.text and "french" in r.text  # before: every team's
    r = http.post("/v1/completions", headers=bearer(stack.api_key), json={"model": MODEL, "prompt": "Hi",
                                                                          "adapter": "other-secret"})
    assert r.status_code == 403 and "other-team" not in r.text


def test_a_staged_canary_stays_dark_unless_the_caller_may_see_it(stack, http, world):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "version": "2"}
    r = http.post("/v1/completions", headers=bearer(stack.api_key), json=body)
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("version:")  # before: reached it
    r = http.post("/v1/completions", headers=bearer(world["tester"]), json=body)
    assert r.status_code == 503 and "nothing serves or starts" in r.text  # allowed through; no v2 replica runs


def test_adapter_base_version_and_status_are_checked(stack, http):
    def post(**extra):
        return http.post("/v1/completions", headers=bearer(stack.api_key),
                         json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra})
    r = post(adapter="broken")
    assert r.status_code == 503 and "'failed', not ready" in r.text
    r = post(adapter="french", version="2")
    assert r.status_code in (400, 404) and r.json()["error"]["message"].startswith("version:")
    r = post(adapter="for-v2")  # runs on its own base version (v2), never on v1's weights
    assert r.status_code == 503 and "version 2" in r.text
    assert post(adapter="french").status_code == 200


def test_concurrency_cap_and_quota_survive_a_router_restart(stack, http):
    capped = registry_write(stack, lambda s: queries.create_caller(s, "capped", "dev-team", max_concurrent=1))
    quota = registry_write(stack, lambda s: queries.create_caller(s, "metered", "dev-team", token_quota_per_day=100))
    with httpx.Client(base_url=stack.http_url, timeout=60) as other:
        with other.stream("POST", "/v1/chat/completions", headers=bearer(capped),
                          json={"model": MODEL, "max_tokens": 300, "temperature": 0, "stream": True,
                                "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}) as s:
            assert s.status_code == 200, s.read()
            lines = s.iter_lines()  # kept: a dropped iterator closes the stream
            assert '"content"' in next(lines)  # streaming: the first stream holds the caller's only slot
            r = http.post("/v1/completions", headers=bearer(capped), json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 429 and "concurrency" in r.text  # before: no per-caller cap
    first = http.post("/v1/completions", headers=bearer(quota), json={"model": MODEL, "prompt": "Hi", "max_tokens": 20})
    used = first.json()["usage"]["total_tokens"]
    stack.restart_router({})
    r = httpx.post(f"{stack.http_url}/v1/completions", headers=bearer(quota), timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 100 - used})
    assert r.status_code == 429 and f"has used {used} of 100" in r.text  # before: a restart reset the day's usage


def test_named_admin_tokens_are_hashed_revocable_and_audited(stack, http):
    cli = [sys.executable, "-m", "fleet.cli", "admin-token"]
    made = subprocess.run([*cli, "create", "--name", "alice", "--role", "operator"], env=stack.env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    with __import__("registry.db", fromlist=["session_scope"]).session_scope(stack.settings.db_url) as s:
        rows = s.query(AdminToken).all()
        assert token not in {r.token_hash for r in rows} and queries.hash_api_key(token) in {r.token_hash for r in rows}
    headers = bearer(token)
    for _ in range(50):  # the router reloads the registry within a second
        if http.get("/admin/whoami", headers=headers).status_code == 200:
            break
        __import__("time").sleep(0.1)
    assert http.get("/admin/whoami", headers=headers).json() == {"role": "operator", "name": "alice"}
    for action in ("drain", "uncordon"):  # a change and its undo, both audited under the token's name
        assert http.post(f"/admin/replicas/{stack.replica_ids[0]}/{action}", headers=headers).status_code == 200
    audit = http.get("/admin/audit", headers=headers).json()["entries"]
    assert [(a["actor"], a["action"]) for a in audit[:2]] == [("alice", "replica_serving"),
                                                             ("alice", "replica_draining")]  # before: "operator"
    viewer = subprocess.run([*cli, "create", "--name", "vera", "--role", "viewer"], env=stack.env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[-1]
    revoked = subprocess.run([*cli, "revoke", "--name", "alice"], env=stack.env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=120)
    assert revoked.returncode == 0, revoked.stderr
    for _ in range(50):
        if http.get("/admin/whoami", headers=headers).status_code == 401:
            break
        __import__("time").sleep(0.1)
    assert http.get("/admin/whoami", headers=headers).status_code == 401
    r = http.post(f"/admin/models/{MODEL}/rollback", headers=bearer(viewer))
    assert r.status_code in (401, 403)
