"""Kubernetes actuator against a real HTTP server replaying API-reference responses (tests/autoscale/contracts/).

The server checks every request the official client makes (method, path, content type, body) against
the recorded contract, in order, and answers with the recorded response.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from autoscale.actuators import PoolSpec
from autoscale.actuators.kubernetes import KubernetesActuator, deployment_manifest
from registry.db import migrate

CONTRACTS = Path(__file__).parent / "contracts"
LARGE = PoolSpec("large-70b-fp8", "v1", "region-a", tensor_parallel=4)
SMALL = PoolSpec("small-8b-fp16", "v1", "region-a", tensor_parallel=1)


class ContractServer:
    """Replays one contract file; records what the client actually sent."""

    def __init__(self, contract: str) -> None:
        self.interactions = json.loads((CONTRACTS / contract).read_text())["interactions"]
        self.received: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                outer.received.append({"method": self.command, "path": self.path.split("?")[0],
                                       "query": self.path.split("?", 1)[1] if "?" in self.path else "",
                                       "content_type": self.headers.get("content-type", ""),
                                       "body": json.loads(raw) if raw else None})
                index = len(outer.received) - 1
                resp = outer.interactions[index]["response"] if index < len(outer.interactions) else \
                    {"status": 500, "body": {"kind": "Status", "message": "unexpected request"}}
                payload = json.dumps(resp["body"]).encode()
                self.send_response(resp["status"])
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ContractServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def actuator(self, db_url: str | None = None, **kwargs) -> KubernetesActuator:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return KubernetesActuator("llm", api_client=client.ApiClient(cfg), db_url=db_url, **kwargs)

    def verify(self) -> None:
        assert len(self.received) == len(self.interactions), self.received
        for got, contract in zip(self.received, self.interactions):
            want = contract["request"]
            assert (got["method"], got["path"]) == (want["method"], want["path"])
            if "query" in want:
                assert got["query"] == want["query"]
            if "content_type" in want:
                assert got["content_type"].split(";")[0] == want["content_type"]
            if "body" in want:
                assert got["body"] == want["body"]
            if "body_subset" in want:
                _assert_subset(want["body_subset"], got["body"])
            for dotted in want.get("body_absent", []):
                node = got["body"]
                for part in dotted.split("."):
                    node = node.get(part, {}) if isinstance(node, dict) else {}
                assert node == {}, f"{dotted} must not be sent"
            if "container_resources" in want:
                container = got["body"]["spec"]["template"]["spec"]["containers"][0]
                assert container["resources"] == want["container_resources"]


def _assert_subset(want, got, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: expected an object, got {got!r}"
        for key, value in want.items():
            assert key in got, f"{path}.{key} missing"
            _assert_subset(value, got[key], f"{path}.{key}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_scale_reads_counts_registers_pods_measures_cold_start_and_patches_scale(sqlite_url) -> None:
    from registry import queries
    from registry.db import migrate, session_scope

    migrate(sqlite_url)
    with session_scope(sqlite_url) as s:  # a replica whose pod is gone must leave the registry
        queries.upsert_replica(s, "llm-large-70b-fp8-v1-old", model=LARGE.model, version=LARGE.version,
                               region=LARGE.region, grpc_url="10.8.1.1:8001", http_url="", state="serving", pid=0)
    with ContractServer("deployment_scale.json") as server:
        actuator = server.actuator(sqlite_url)
        counts = actuator.counts(LARGE)
        assert (counts.serving, counts.starting, counts.draining) == (1, 1, 0)
        actuator.scale(LARGE, 5)
    server.verify()
    with session_scope(sqlite_url) as s:
        rows = {r.replica_id: (r.state, r.grpc_url) for r in queries.list_replicas(s, LARGE.model)}
    assert rows == {"llm-large-70b-fp8-v1-7d9c8b6f5-abcde": ("serving", "10.8.3.17:8001"),
                    "llm-large-70b-fp8-v1-7d9c8b6f5-fghij": ("starting", "10.8.5.4:8001")}
    assert actuator.cold_start_s(LARGE) == 425.0  # Ready 10:07:05 - created 10:00:00


@pytest.mark.parametrize("cordoned_by", ["router", "operator"])
def test_a_pod_a_router_cordoned_is_missing_capacity_and_deleted_when_its_probes_keep_failing(
        sqlite_url, cordoned_by) -> None:
    from registry import queries
    from registry.db import migrate, session_scope

    migrate(sqlite_url)
    pod = "llm-large-70b-fp8-v1-7d9c8b6f5-abcde"
    with session_scope(sqlite_url) as s:
        queries.upsert_replica(s, pod, model=LARGE.model, version=LARGE.version, region=LARGE.region,
                               grpc_url="10.8.3.17:8001", http_url="http://10.8.3.17:8000", state="serving", pid=0,
                               metrics_url="http://10.8.3.17:8002/metrics")
        queries.set_replica_state(s, pod, "cordoned", actor=cordoned_by)
    with ContractServer("pod_heal.json") as server:
        actuator = server.actuator(sqlite_url, restart_cordoned_after_s=0.0)
        counts = actuator.counts(LARGE)
        # the Ready pod keeps the router's cordon (the registrar does not write it back to serving) and is not
        # capacity: 2 wanted, 1 cordoned, 1 starting
        assert (counts.serving, counts.starting, counts.cordoned) == (0, 1, 1)
        with session_scope(sqlite_url) as s:
            assert {r.replica_id: r.state for r in queries.list_replicas(s, LARGE.model)}[pod] == "cordoned"
        actuator.scale(LARGE, 5)  # the cordoned pod's slot is added: 6
        deleted = actuator.heal(LARGE)
    if cordoned_by == "router":
        assert deleted == [pod]
        server.verify()
    else:  # an operator's cordon is the operator's to lift: no DELETE
        assert deleted == []
        assert [r["method"] for r in server.received] == ["GET", "GET", "PATCH", "GET"]


def test_scale_creates_the_workload_when_it_does_not_exist(sqlite_url) -> None:
    migrate(sqlite_url)  # the version's build info (its GPU pin) is read from the registry: no row, no pin
    with ContractServer("deployment_scale_missing.json") as server:
        server.actuator(sqlite_url).scale(LARGE, 3)
    server.verify()


def test_manifest_is_the_pool_template_and_valid_for_the_kubernetes_models() -> None:
    from tests.deploy.k8s_schema import deserialize, unknown_fields

    manifest = deployment_manifest(LARGE, "llm", replicas=2)
    assert unknown_fields(manifest, "V1Deployment") == []
    pod = deserialize(manifest).spec.template.spec
    triton = next(c for c in pod.containers if c.name == "triton")
    env = {e.name: e.value for e in triton.env}
    assert env["FLEET_TENSOR_PARALLEL"] == "4" and triton.resources.limits["nvidia.com/gpu"] == "4"
    assert triton.command[:3] == ["python3", "-m", "build_engines.launch"]
    assert [c.name for c in pod.init_containers] == ["stage-weights"]
    assert {c.name for c in pod.containers} == {"triton", "state"}


def test_scale_of_a_new_version_applies_the_overlays_template_server_side(sqlite_url) -> None:
    """A rollout's new version: no Deployment yet, so it is applied from the model's overlay Deployment (its
    image, runtime class, grace period), renamed to the overlay's naming and relabelled for the new pool."""
    migrate(sqlite_url)
    with ContractServer("deployment_create.json") as server:
        assert server.actuator(sqlite_url).ensure_workload(LARGE, replicas=2) == "llm-pool-large-70b-fp8-v1"
    server.verify()
    sent = server.received[1]["body"]
    triton = sent["spec"]["template"]["spec"]["containers"][0]
    assert triton["image"] == "registry.example.com/llm-fleet-gpu:0.2.0-trtllm0.17"  # the overlay's, not a default
    assert {"name": "FLEET_VERSION", "value": "v1"} in triton["env"]
    assert sent["spec"]["template"]["metadata"]["labels"]["fleet.ai/pool"] == "large-70b-fp8-v1"


def test_adopt_reapplies_a_deployment_the_actuator_made_with_its_replicas(sqlite_url) -> None:
    migrate(sqlite_url)
    with ContractServer("deployment_adopt.json") as server:
        server.actuator(sqlite_url).adopt(SMALL)
    server.verify()


def test_api_error_surfaces() -> None:
    from kubernetes.client.exceptions import ApiException

    with ContractServer("deployment_scale_missing.json") as server:  # first answer is a 404
        with pytest.raises(ApiException) as info:
            server.actuator().apps.patch_namespaced_deployment_scale("llm-pool-large-70b-fp8-v1", "llm",
                                                                     {"spec": {"replicas": 3}})
        assert info.value.status == 404


def test_manifest_shape() -> None:
    manifest = deployment_manifest(LARGE, "llm")
    pod = manifest["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod or "fleet.ai/tp-group" not in pod["nodeSelector"]  # no label nothing sets
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert "preStop" in pod["containers"][0]["lifecycle"]
    assert "replicas" not in manifest["spec"]


def test_hostile_names_become_valid_kubernetes_names() -> None:
    """What the API server refuses with 422 (`/`, `+`, upper case, label values over 63 characters)."""
    from autoscale.actuators.k8s_names import dns_label, label_value
    from tests.deploy.k8s_schema import deserialize

    hostile = PoolSpec("meta-llama/Llama-3.1-70B-Instruct-with-a-very-long-fine-tune-name-x" * 2, "v2+lora",
                       "region-a", tensor_parallel=4)
    manifest = deployment_manifest(hostile, "llm", replicas=1)
    name = manifest["metadata"]["name"]
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    for key, value in manifest["spec"]["template"]["metadata"]["labels"].items():
        assert len(value) <= 63 and re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value), (key, value)
    assert manifest["metadata"]["annotations"]["fleet.ai/model"] == hostile.model  # exact name kept
    deserialize(manifest)
    assert dns_label("Llama.3") != dns_label("llama-3")  # changed names carry a hash of the original
    assert label_value("llama-70b-1") == "llama-70b-1"  # valid names are kept as they are
