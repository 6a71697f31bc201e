"""Kubernetes actuator against a real HTTP server replaying API-reference responses (tests/autoscale/contracts/).

The server checks every request the official client makes (method, path, content type, body) against
the recorded contract, in order, and answers with the recorded response.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from autoscale.actuators import PoolSpec
from autoscale.actuators.kubernetes import KubernetesActuator, deployment_manifest

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

    def actuator(self) -> KubernetesActuator:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return KubernetesActuator("llm", api_client=client.ApiClient(cfg))

    def verify(self) -> None:
        assert len(self.received) == len(self.interactions), self.received
        for got, contract in zip(self.received, self.interactions):
            want = contract["request"]
            assert (got["method"], got["path"]) == (want["method"], want["path"])
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


def test_scale_reads_counts_and_patches_scale_subresource() -> None:
    with ContractServer("deployment_scale.json") as server:
        actuator = server.actuator()
        counts = actuator.counts(LARGE)
        assert (counts.serving, counts.starting, counts.draining) == (1, 1, 0)
        actuator.scale(LARGE, 5)
    server.verify()


def test_ensure_workload_creates_tp4_deployment_with_node_selector_and_gpus() -> None:
    with ContractServer("deployment_create.json") as server:
        assert server.actuator().ensure_workload(LARGE, replicas=2) == "llm-large-70b-fp8-v1"
    server.verify()


def test_ensure_workload_patches_existing_deployment_without_touching_replicas() -> None:
    with ContractServer("deployment_patch.json") as server:
        server.actuator().ensure_workload(SMALL)
    server.verify()


def test_api_error_surfaces() -> None:
    from kubernetes.client.exceptions import ApiException

    with ContractServer("deployment_create.json") as server:  # first answer is a 404 for the scale read
        with pytest.raises(ApiException) as info:
            server.actuator().apps.read_namespaced_deployment_scale("llm-large-70b-fp8-v1", "llm")
        assert info.value.status == 404


def test_manifest_shape() -> None:
    manifest = deployment_manifest(LARGE, "llm")
    pod = manifest["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["fleet.ai/tp-group"] == "tp4"
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert "preStop" in pod["containers"][0]["lifecycle"]
    assert "replicas" not in manifest["spec"]
