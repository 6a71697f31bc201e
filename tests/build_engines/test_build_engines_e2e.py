"""End to end on CPU: build version 2 of SmolLM2 with build-engines, a real Triton replica serves it, a rollout
gives it a share of the traffic, and it answers."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from build_engines.build import build
from build_engines.plan import parse_options
from autoscale.actuators.replicas import PORTS_PER_REPLICA, ReplicaSpec, replica_base_port, start_replica, stop_replica
from common.services import replica_ports
from common.settings import Settings, load_settings
from registry.db import session_scope
from registry.queries import routes_for, set_routes
from tests.integration.platform import stream_completion

pytestmark = pytest.mark.integration
CHATML = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _free_base() -> int:
    """A base port whose whole replica block (http, grpc, metrics) is free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + PORTS_PER_REPLICA < 65000 and all(_free(base + i) for i in range(3)):
            return base
    raise RuntimeError("no free port block")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def ask(grpc_url: str, text: str, max_tokens: int = 16) -> tuple[str, list]:
    """Straight to a replica's ensemble `llm` (no router, no auth)."""
    out = stream_completion(grpc_url, text, "llm", max_tokens)
    return "".join(r.as_numpy("text_output")[0].decode() for r in out), out


def test_build_v2_serve_rollout_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path) -> None:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path / "data"))
    base = _free_base()
    monkeypatch.setenv("FLEET_REPLICA_BASE_PORT", str(base))
    settings: Settings = load_settings()
    for version in ("1", "2"):
        res = build(parse_options(model="smollm2-135m", version=version, checkpoint="smollm2", target="cpu"),
                    settings)
        assert res.row["status"] == "staged"
    with session_scope(settings.db_url) as s:
        set_routes(s, "smollm2-135m", {"1": 100}, actor="test")
        set_routes(s, "smollm2-135m", {"1": 80, "2": 20}, actor="test")  # the rollout: 20 % to version 2
        split = routes_for(s, "smollm2-135m")
    from router_service.rollout import pick_version
    picks = [pick_version(split, f"caller-{i}") for i in range(1000)]
    assert 150 < picks.count("2") < 250
    spec = ReplicaSpec("smollm2-135m", "2", 0)
    cold_s = start_replica(settings, spec)
    try:
        _, grpc, _ = replica_ports(replica_base_port(settings, 0))
        text, responses = ask(f"127.0.0.1:{grpc}", CHATML)
        assert "Paris" in text, text
        assert responses[-1].as_numpy("finish_reason")[0] in (b"stop", b"length")
        assert cold_s < 120
    finally:
        stop_replica(settings, spec.replica_id)
