"""Issue 12, holes 1 and 2: replica state reports reach the router only on its internal listener and only
when signed by the reporting replica's own key; a report can never lift a cordon; replicas listen on
loopback and their engine takes adapter names, never paths."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import shutil
import time

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from common.report_channel import (REPLICA_HEADER, REPORT_PATH, SIGNATURE_HEADER, load_report_secret, replica_key,
                                  sign_head)
from registry import queries
from registry.db import migrate, session_scope
from router_service.core import Router
from router_service.registry_cache import RegistryCache, load_snapshot
from tests.security.conftest import MODEL, bearer

pytestmark = pytest.mark.integration


def _report(replica_id: str, **fields) -> dict:
    return {"replica_id": replica_id, "model": MODEL, "version": "1", "kv_blocks_total": 512, "kv_blocks_free": 512,
            "block_size": 16, "full_snapshot": True, "prefix_hashes": [], **fields}


def _post(stack, report: dict, key: str | None, replica_id: str | None = None, body: bytes | None = None):
    body = body if body is not None else json.dumps(report).encode()
    headers = {"content-type": "application/json", REPLICA_HEADER: replica_id or report["replica_id"]}
    if key is not None:
        headers[SIGNATURE_HEADER] = sign_head(key, replica_id or report["replica_id"], body)
    return httpx.post(stack.settings.router_internal_url + REPORT_PATH, content=body, headers=headers, timeout=5)


def _complete(http, stack) -> httpx.Response:
    return http.post("/v1/completions", headers=bearer(stack.api_key),
                     json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})


def test_callers_port_has_no_report_endpoint(stack, http):
    r = http.post(REPORT_PATH, json=_report(stack.replica_ids[0], block_size="abc"))
    assert r.status_code == 404  # before: 200, and every later completion failed with 500


def test_internal_listener_refuses_unsigned_forged_and_unknown_reports(stack, http):
    rid = stack.replica_ids[0]
    secret = load_report_secret(stack.settings)
    assert _post(stack, _report(rid, draining=True), key=None).status_code == 401
    other = _post(stack, _report(rid, draining=True), key=replica_key(secret, "someone-else"))
    assert other.status_code == 401 and "does not match" in other.json()["error"]["message"]
    made_up = _post(stack, _report("made-up-replica"), key=replica_key(secret, "made-up-replica"))
    assert made_up.status_code == 404 and "not registered" in made_up.json()["error"]["message"]
    stale_body = json.dumps(_report(rid)).encode()
    stale = httpx.post(stack.settings.router_internal_url + REPORT_PATH, content=stale_body, timeout=5,
                       headers={REPLICA_HEADER: rid, SIGNATURE_HEADER: sign_head(replica_key(secret, rid), rid, stale_body,
                                                                               int(time.time()) - 600)})
    assert stale.status_code == 401 and "timestamp" in stale.json()["error"]["message"]
    assert _complete(http, stack).status_code == 200  # nothing above changed routing


def test_signed_reports_must_fit_the_schema(stack, http):
    rid = stack.replica_ids[0]
    key = replica_key(load_report_secret(stack.settings), rid)
    for bad, field in ((_report(rid, block_size="abc"), "block_size"), (_report(rid, prefix_hashes=["x"]), "prefix_hashes"),
                       (_report(rid, running=-1), "running"), (_report(rid, colour="red"), "colour"),
                       (_report(rid, draining="yes"), "draining")):
        r = _post(stack, bad, key)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    assert _post(stack, _report("x"), key, replica_id=rid).status_code == 403  # body speaks for another replica
    assert _complete(http, stack).status_code == 200
    assert stack.fleet()["replicas"][0]["reporting"]  # the real replica's own signed reports are accepted


def test_a_report_cannot_lift_the_routers_cordon(sqlite_url):
    migrate(sqlite_url)
    with session_scope(sqlite_url) as s:
        queries.upsert_model_version(s, "m", "1", status="serving", max_context=2048)
        queries.upsert_replica(s, "r0", model="m", version="1", grpc_url="127.0.0.1:1", http_url="http://x",
                               state="serving", pid=100)
    router = Router(RegistryCache(sqlite_url))
    model = router.registry.snapshot.models["m"]["1"]

    async def main():
        router.cordon("r0", "stream broke")
        await asyncio.sleep(1.2)  # before the fix, any full snapshot 1 s after the cordon lifted it
        router.replica_state.apply(_report("r0", model="m"))
        assert router.serving_replicas(model, set()) == []
        with session_scope(sqlite_url) as s:  # the actuator restarts it: a new process, serving again
            queries.upsert_replica(s, "r0", state="serving", pid=200)
        router.registry.snapshot = load_snapshot(sqlite_url)
        assert [r.replica_id for r in router.serving_replicas(model, set())] == ["r0"]
    asyncio.run(main())


def test_replicas_listen_on_loopback_only(stack):
    with session_scope(stack.settings.db_url) as s:
        replica = queries.list_replicas(s)[0]
    ports = {int(replica.grpc_url.rsplit(":", 1)[1]), int(replica.http_url.rsplit(":", 1)[1]),
             int(replica.metrics_url.rsplit(":", 2)[2].split("/")[0])}
    listening = {c.laddr.port: c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN"}
    assert set(listening) >= ports, (ports, listening)
    for port in ports:  # before: 0.0.0.0 (every interface)
        ip = ipaddress.ip_address(listening[port])
        assert (getattr(ip, "ipv4_mapped", None) or ip).is_loopback, (port, listening[port])


def test_engine_takes_adapter_names_never_paths(stack, tmp_path, http):
    # a valid adapter folder outside the replica's adapters dir, named by absolute path
    outside = tmp_path / "evil-adapter"
    shutil.copytree(stack.settings.data_dir / "adapters" / "french", outside)
    with session_scope(stack.settings.db_url) as s:
        grpc_url = queries.list_replicas(s)[0].grpc_url
    client = grpcclient.InferenceServerClient(grpc_url)
    ids = grpcclient.InferInput("input_ids", [3], "INT32")
    ids.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
    mt = grpcclient.InferInput("max_tokens", [1], "INT32")
    mt.set_data_from_numpy(np.array([2], dtype=np.int32))
    lora = grpcclient.InferInput("lora_name", [1], "BYTES")
    lora.set_data_from_numpy(np.array([str(outside).encode()], dtype=object))
    results = []
    client.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        client.async_stream_infer("engine", [ids, mt, lora], request_id="path")
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.stop_stream()
        client.close()
    result, error = results[0]
    # before: it generated; the refusal is an error response with the engine's message (router: a 400)
    assert result is None and f"refused: unknown adapter '{outside}'" in str(error)
    log = (stack.settings.logs_dir / f"replica-{stack.replica_ids[0]}.log").read_text()
    assert f"unknown adapter '{outside}'" in log
    r = http.post("/v1/completions", headers=bearer(stack.api_key),
                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "adapter": str(outside)})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("adapter:")
