"""A small real stack for the admin UI tests: a migrated SQLite registry, the real router HTTP app served
by uvicorn on a free port in a background thread, and a DuckDB usage store filled through usage.store.

Nothing is faked: the UI reads the same registry and store files and writes through the same admin API
as in production; only replicas are not running (their state reports are applied to the router directly,
exactly as `/internal/replica-state` does).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import uvicorn

from common.processes import free_port, port_open
from registry import queries
from registry.admin_tokens import set_admin_token
from registry.db import migrate, session_scope
from registry.schema import WarmBuffer
from router_service.core import Router
from router_service.http_frontend import create_app
from router_service.registry_cache import RegistryCache
from usage import store
from tests.admin_ui.gate_reports import gate_report

OPERATOR_TOKEN, VIEWER_TOKEN = "fa-test-operator", "fv-test-viewer"
MODEL = "smollm2-135m"


@dataclass
class Stack:
    data_dir: Path
    db_url: str
    port: int
    router: Router
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def env(self) -> dict[str, str]:
        return {"FLEET_DATA_DIR": str(self.data_dir), "FLEET_DB_URL": self.db_url,
                "FLEET_ROUTER_HTTP_PORT": str(self.port)}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def seed_registry(db_url: str) -> None:
    migrate(db_url)
    with session_scope(db_url) as s:
        queries.upsert_model_version(s, MODEL, "1", status="serving", max_context=2048, engine_kind="cpu",
                                     build_info={"builder": "build_engines cpu", "git": "abc123"},
                                     quality_gate=gate_report(0.97))
        queries.upsert_model_version(s, MODEL, "2", status="staged", max_context=2048, engine_kind="cpu",
                                     build_info={"builder": "build_engines cpu", "git": "def456"},
                                     quality_gate=gate_report(0.95))
        queries.set_routes(s, MODEL, {"1": 100}, actor="seed")
        for i, version in enumerate(("1", "1", "2")):
            queries.upsert_replica(s, f"{MODEL}-v{version}-r{i}", model=MODEL, version=version, region="local",
                                   grpc_url=f"127.0.0.1:{9000 + i}", http_url=f"http://127.0.0.1:{9100 + i}",
                                   state="serving")
        s.add(WarmBuffer(model=MODEL, version="1", min_idle_replicas=1, min_replicas=1, max_replicas=3,
                         slo_ttft_ms_p95=500, slo_tokens_per_s=40))
        queries.create_caller(s, "search-svc", "search", api_key="k-search")
        queries.create_caller(s, "chat-svc", "assistant", api_key="k-chat")
        set_admin_token(s, "alice", "operator", OPERATOR_TOKEN)
        set_admin_token(s, "victor", "viewer", VIEWER_TOKEN)


def seed_usage(path: Path, now: float | None = None) -> int:
    """A day of events for two teams and two versions (version 2 slower, with errors)."""
    now = now or time.time()
    rows = []
    for i in range(60):
        version = "2" if i % 3 == 0 else "1"
        team, caller = (("search", "search-svc") if i % 2 else ("assistant", "chat-svc"))
        rows.append({"request_id": f"req-{uuid.uuid4().hex}", "ts": now - 3000 + i * 40, "caller": caller,
                     "team": team, "model": MODEL, "version": version, "adapter": "", "priority": "interactive",
                     "region": "local", "replica_id": f"{MODEL}-v{version}-r0", "prompt_tokens": 200 + i,
                     "cached_prompt_tokens": 64 if i % 4 == 0 else 0, "completion_tokens": 30,
                     "ttft_ms": 120.0 + (150 if version == "2" else 0) + i, "duration_ms": 900.0 + i * 3,
                     "finish_reason": "length", "status": "error" if version == "2" and i % 9 == 0 else "ok"})
    with store.connect(path) as con:
        return store.insert_events(con, pd.DataFrame(rows, columns=store.EVENT_COLUMNS))


def start_stack(data_dir: Path) -> Stack:
    data_dir.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{data_dir / 'registry.sqlite'}"
    seed_registry(db_url)
    (data_dir / "admin-token").write_text(OPERATOR_TOKEN + "\n")
    (data_dir / "viewer-token").write_text(VIEWER_TOKEN + "\n")
    seed_usage(data_dir / "usage.duckdb")
    router = Router(RegistryCache(db_url))
    router.replica_state.stale_after_s = 3600.0  # reports below stand for a replica that keeps reporting
    for i, rid in enumerate(r.replica_id for r in router.registry.snapshot.replicas):
        router.replica_state.apply({"replica_id": rid, "model": MODEL, "kv_blocks_total": 512,
                                    "kv_blocks_free": 512 - 100 * (i + 1), "block_size": 16, "running": 2 + i,
                                    "waiting": i, "queue_wait_ms_p95": 20.0 * i, "ttft_ms_p95": 250.0 + 200 * i,
                                    "tokens_per_s": 80.0 - 10 * i, "adapters_loaded": [], "full_snapshot": True})
    port = free_port()
    app = create_app(router)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=server.run, name="router-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not port_open("127.0.0.1", port):
        if time.monotonic() > deadline:
            raise RuntimeError("the router HTTP app did not start")
        time.sleep(0.05)
    return Stack(data_dir, db_url, port, router, server, thread)
