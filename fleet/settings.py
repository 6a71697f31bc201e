"""Platform settings: ports, data dir and service URLs, from DESIGN.md §7 defaults, overridable by env.

One place that every component reads, so a port or path is never spelled twice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    db_url: str
    kafka_bootstrap: str
    router_host: str
    router_http_port: int
    router_grpc_port: int
    admin_ui_port: int
    kafka_port: int
    replica_base_port: int
    router_internal_host: str = "127.0.0.1"
    router_internal_port: int = 8032
    replica_bind: str = "127.0.0.1"
    usage_topic: str = "llm.usage.v1"
    usage_dlq_topic: str = "llm.usage.v1.dlq"
    region: str = "local"

    @property
    def router_http_url(self) -> str:
        return f"http://{self.router_host}:{self.router_http_port}"

    @property
    def router_internal_url(self) -> str:
        """The router's internal listener (replica state reports), never the callers' port."""
        return f"http://{self.router_internal_host}:{self.router_internal_port}"

    @property
    def router_grpc_url(self) -> str:
        return f"{self.router_host}:{self.router_grpc_port}"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def spool_dir(self) -> Path:
        return self.data_dir / "spool"

    @property
    def usage_db_path(self) -> Path:
        return self.data_dir / "usage.duckdb"

    @property
    def engines_dir(self) -> Path:
        return self.data_dir / "engines"

    @property
    def vendor_dir(self) -> Path:
        # Installed binaries are shared by every data dir (tests use throwaway data dirs).
        return Path(os.environ.get("FLEET_VENDOR_DIR", REPO_ROOT / ".fleet" / "vendor"))

    @property
    def cache_dir(self) -> Path:
        # Converted weights and other artefacts that are slow to make and safe to share.
        return Path(os.environ.get("FLEET_CACHE_DIR", REPO_ROOT / ".fleet" / "cache"))

    @property
    def dev_api_key_file(self) -> Path:
        return self.data_dir / "dev-api-key"

    @property
    def admin_token_file(self) -> Path:
        return self.data_dir / "admin-token"

    @property
    def viewer_token_file(self) -> Path:
        return self.data_dir / "viewer-token"

    @property
    def report_secret_file(self) -> Path:
        return self.data_dir / "report-secret"


def load_settings() -> Settings:
    data_dir = Path(os.environ.get("FLEET_DATA_DIR", REPO_ROOT / ".fleet")).resolve()
    kafka_port = _env_int("FLEET_KAFKA_PORT", 9092)
    return Settings(
        data_dir=data_dir,
        db_url=os.environ.get("FLEET_DB_URL", f"sqlite:///{data_dir / 'registry.sqlite'}"),
        kafka_bootstrap=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", f"127.0.0.1:{kafka_port}"),
        router_host=os.environ.get("FLEET_ROUTER_HOST", "127.0.0.1"),
        router_http_port=_env_int("FLEET_ROUTER_HTTP_PORT", 8030),
        router_grpc_port=_env_int("FLEET_ROUTER_GRPC_PORT", 8031),
        admin_ui_port=_env_int("FLEET_ADMIN_UI_PORT", 8501),
        kafka_port=kafka_port,
        replica_base_port=_env_int("FLEET_REPLICA_BASE_PORT", 8100),
        router_internal_host=os.environ.get("FLEET_ROUTER_INTERNAL_HOST", "127.0.0.1"),
        router_internal_port=_env_int("FLEET_ROUTER_INTERNAL_PORT", 8032),
        replica_bind=os.environ.get("FLEET_REPLICA_BIND", "127.0.0.1"),
        region=os.environ.get("FLEET_REGION", "local"),
    )
