"""One real platform slice for the security tests: a router (with usage metering to a real tansu broker)
in front of one real Triton replica running SmolLM2, on free ports and a throwaway data dir."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2_grpc

from registry import queries
from registry.db import session_scope
from tests.integration.router_stack import RouterStack

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def stack(tmp_path_factory, kafka_bootstrap):
    s = RouterStack.start(tmp_path_factory.mktemp("security-stack"), replicas=1,
                          router_env={"KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "FLEET_ROUTER_RATE_LIMIT_RPS": "1000",
                                      "FLEET_ROUTER_RATE_LIMIT_BURST": "1000"},
                          router_args=())
    yield s
    s.stop()


@pytest.fixture(scope="session")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def kserve(stack):
    channel = grpc.insecure_channel(stack.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def registry_write(stack: RouterStack, fn) -> object:
    """Change the registry and wait until the router has reloaded it (it polls every 0.5 s)."""
    with session_scope(stack.settings.db_url) as s:
        result = fn(s)
        queries.bump_version(s)
    with session_scope(stack.settings.db_url) as s:
        target = queries.registry_version(s)
    deadline = time.monotonic() + 10
    while httpx.get(f"{stack.http_url}/health", timeout=5).json()["registry_version"] < target:
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not reload the registry")
        time.sleep(0.1)
    return result
