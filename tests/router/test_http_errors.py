"""OpenAI HTTP frontend without replicas: every kind of bad input gets a 4xx naming the problem, and
the gateway's tier, adapter-ownership and quota checks."""
import pytest
from fastapi.testclient import TestClient

from registry import queries
from registry.schema import Adapter
from router_service.core import Router
from router_service.http_frontend import create_app
from router_service.registry_cache import RegistryCache


@pytest.fixture
def http(sqlite_url, seeded):
    keys = {}

    def callers_and_adapter(s):
        keys.update(dev=queries.create_caller(s, "dev", "team-a"),
                    batchy=queries.create_caller(s, "batchy", "team-b", max_tier="batch"),
                    tiny=queries.create_caller(s, "tiny", "team-a", token_quota_per_day=10))
        s.add(Adapter(name="sql", base_model="m", base_version="1", uri="/x", rank=8, owner_team="team-a",
                      status="ready"))
    seeded(sqlite_url, extra=callers_and_adapter)
    router = Router(RegistryCache(sqlite_url))
    client = TestClient(create_app(router))
    return client, {k: {"authorization": f"Bearer {v}"} for k, v in keys.items()}


@pytest.mark.parametrize("body,status,match", [
    ("{not json", 400, "body: not valid JSON"),
    ({"model": "m", "prompt": "hi", "colour": "red"}, 400, "colour: Extra inputs are not permitted"),
    ({"model": "m", "prompt": "   "}, 400, "prompt: Value error, the prompt is empty"),
    ({"model": "m", "prompt": "hi", "deadline_ms": -5}, 400, "deadline_ms: must be positive"),
    ({"model": "m", "prompt": "hi", "deadline_ms": 10**15}, 400, "deadline_ms: is more than 7 days away"),
    ({"model": "m", "prompt": "hi", "priority": "urgent"}, 400, "priority: 'urgent' is not a tier"),
    ({"model": "m", "prompt": "hi", "version": "9"}, 404, "no version '9'"),
    ({"model": "m", "prompt": "hi", "adapter": "nope"}, 404, "adapter: 'nope' does not exist"),
    ({"model": "m", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens: must be a positive integer"),
    ({"model": "m", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens: must be a positive integer, got 0"),
    ({"model": "m", "prompt": "hi", "max_completion_tokens": 0}, 400, "max_tokens: must be a positive integer"),
        ({"model": "m", "prompt": "x" * 10_000_000}, 413, "over the limit"),
])
def test_bad_requests_get_clear_4xx(http, body, status, match):
    client, keys = http
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    r = client.post("/v1/completions", headers=keys["dev"], **kwargs)
    assert r.status_code == status, r.text
    assert match in r.json()["error"]["message"]


def test_invalid_utf8_body_is_a_400(http):
    client, keys = http
    r = client.post("/v1/completions", headers=keys["dev"], content=b'{"model": "m", "prompt": "\xff\xfe"}')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_tier_adapter_and_quota_rights(http):
    client, keys = http
    r = client.post("/v1/completions", headers=keys["batchy"], json={"model": "m", "prompt": "hi", "priority": "interactive"})
    assert r.status_code == 403 and "above caller 'batchy'" in r.json()["error"]["message"]
    r = client.post("/v1/completions", headers=keys["batchy"], json={"model": "m", "prompt": [1, 2], "adapter": "sql",
                                                                      "priority": "batch"})
    assert r.status_code == 403 and "does not belong to team 'team-b'" in r.json()["error"]["message"]
    r = client.post("/v1/completions", headers=keys["tiny"], json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 16})
    assert r.status_code == 429 and "token quota" in r.json()["error"]["message"] and int(r.headers["retry-after"]) > 0
    # quota checks pass for dev, then no replica is serving: 503 with a retry-after, and nothing stays reserved
    r = client.post("/v1/completions", headers=keys["dev"], json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status_code == 503 and "nothing serves or starts m version 1" in r.json()["error"]["message"]
    r = client.post("/v1/requests/abc/cancel", headers=keys["dev"])
    assert r.status_code == 404


def test_models_list_shows_context_tiers_and_status(http):
    client, keys = http
    data = client.get("/v1/models", headers=keys["dev"]).json()["data"]
    assert data[0]["id"] == "m" and data[0]["max_context"] == 2048 and data[0]["tiers"] == ["interactive", "standard", "batch"]
    assert data[0]["status"] == {"1": "serving"}
