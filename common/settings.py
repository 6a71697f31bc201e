"""Platform settings shared by every component: data dir, registry URL, ports, Kafka, region, tokens.

Read from the environment once, at start (`load_settings()`), then passed in; no other module reads
`os.environ` for these. Defaults are those of docs/architecture.md ("Ports and settings"). Each service
adds its own typed settings on top (router_service/settings.py, python_backends/engine/config.py).
A bad value stops the service at start with pydantic's message naming the variable.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import AliasChoices, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
S = TypeVar("S", bound=BaseSettings)


class Settings(BaseSettings):
    """Every field reads FLEET_<FIELD> (upper case) unless its alias says otherwise."""
    model_config = SettingsConfigDict(env_prefix="FLEET_", frozen=True, extra="ignore")

    data_dir: Path = REPO_ROOT / ".fleet"
    db_url: str = ""  # default: the SQLite file in data_dir
    kafka_port: int = Field(9092, gt=0, lt=65536)
    kafka_bootstrap: str = Field("", validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS"))  # default: local tansu
    router_host: str = "127.0.0.1"
    router_http_port: int = Field(8030, gt=0, lt=65536)
    router_grpc_port: int = Field(8031, gt=0, lt=65536)
    # the router's internal listener (replica state reports): never the callers' port, loopback by default
    router_internal_host: str = "127.0.0.1"
    router_internal_port: int = Field(8032, gt=0, lt=65536)
    # routers behind the shared callers' ports (SO_REUSEPORT); router i's internal listener is port + i
    routers: int = Field(1, ge=1, le=16)
    replica_bind: str = "127.0.0.1"  # address Triton replicas listen on (pod address in Kubernetes)
    # CPU replicas: "dedicated" = the replica owns its cores, OpenMP workers spin between a step's ops;
    # "shared" = replicas share cores, workers sleep soon so they do not starve each other; "auto" = shared
    # when another tritonserver already runs on this host (docs/engine.md "Replicas and cores")
    replica_cpu_cores: Literal["auto", "dedicated", "shared"] = "auto"
    report_secret: str = ""  # signs replica state reports; default: the data dir's report-secret file
    admin_ui_port: int = Field(8501, gt=0, lt=65536)
    replica_base_port: int = Field(8100, gt=0, lt=65536)
    region: str = "local"
    usage_topic: str = "llm.usage.v1"
    usage_dlq_topic: str = "llm.usage.v1.dlq"
    # Installed binaries and converted weights are shared by every data dir (tests use throwaway data dirs).
    vendor_dir: Path = REPO_ROOT / ".fleet" / "vendor"
    cache_dir: Path = REPO_ROOT / ".fleet" / "cache"
    log_level: str = "INFO"
    # text: one human line per event (a terminal); json: one JSON object per line with the request's ids
    # (docs/observability.md "Logs"), what log shippers parse
    log_format: Literal["text", "json"] = "text"
    # OpenTelemetry: traces go to this OTLP/gRPC endpoint (host:port or http://host:port); empty = tracing off
    # (a caller's traceparent is still passed on). Ratio of new traces kept; a sampled caller's trace is kept.
    otlp_endpoint: str = ""
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    triton_otlp_url: str = ""  # GPU replicas: Triton's own OpenTelemetry export (OTLP/HTTP), build_engines/launch.py
    admin_token: str = ""   # operator token; default: the data dir's admin-token file
    viewer_token: str = ""  # read-only token; default: the data dir's viewer-token file
    autoscaler: bool = True  # FLEET_AUTOSCALER=off: `fleet up` starts no autoscaler
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$")  # ISO 4217: the one currency of prices, budgets, GPU cost
    # usage loader's Prometheus metrics (usage/loader_metrics.py): 0 = not served; 9108 in deploy/
    usage_metrics_port: int = Field(0, ge=0, lt=65536)
    usage_metrics_host: str = "127.0.0.1"
    metrics_scrape_s: float = Field(10.0, ge=0.5, le=3600)  # router /metrics -> usage store history, seconds
    usage_fault: Literal["", "mid_write", "after_write"] = ""  # crash tests only: the loader exits there
    trtllm_examples_dir: str = Field("/opt/TensorRT-LLM/examples",
                                     validation_alias=AliasChoices("TRTLLM_EXAMPLES_DIR"))

    @model_validator(mode="after")
    def _derived(self) -> "Settings":
        # Frozen model: derived defaults are set once, here.
        object.__setattr__(self, "data_dir", self.data_dir.resolve())
        if not self.db_url:
            object.__setattr__(self, "db_url", f"sqlite:///{self.data_dir / 'registry.sqlite'}")
        if not self.kafka_bootstrap:
            object.__setattr__(self, "kafka_bootstrap", f"127.0.0.1:{self.kafka_port}")
        return self

    @property
    def kafka_is_external(self) -> bool:
        """KAFKA_BOOTSTRAP_SERVERS was given: use that cluster, start no local broker."""
        return "kafka_bootstrap" in self.model_fields_set

    @property
    def router_http_url(self) -> str:
        return f"http://{self.router_host}:{self.router_http_port}"

    @property
    def router_internal_url(self) -> str:
        return f"http://{self.router_internal_host}:{self.router_internal_port}"

    @property
    def router_internal_urls(self) -> list[str]:
        """Every router's internal listener (replicas report to all of them): router i on port + i."""
        return [f"http://{self.router_internal_host}:{self.router_internal_port + i}" for i in range(self.routers)]

    @property
    def router_metrics_urls(self) -> list[str]:
        """Where each router's own /metrics is read: behind a shared port, its internal listener."""
        return [self.router_http_url] if self.routers == 1 else self.router_internal_urls

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

    def admin_tokens(self) -> dict[str, str]:
        """token -> role (`operator`, `viewer`): from FLEET_ADMIN_TOKEN / FLEET_VIEWER_TOKEN, else the data
        dir's token files (written by `fleet seed`). The router's admin API and the admin UI both use this."""
        tokens: dict[str, str] = {}
        for role, given, path in (("operator", self.admin_token, self.admin_token_file),
                                  ("viewer", self.viewer_token, self.viewer_token_file)):
            try:
                token = given or (path.read_text().strip() if path.exists() else "")
            except OSError:
                token = ""
            if token:
                tokens[token] = role
        return tokens

    def operator_token(self) -> str | None:
        """The operator token (FLEET_ADMIN_TOKEN or the admin-token file), for services that call the admin API."""
        return next((t for t, role in self.admin_tokens().items() if role == "operator"), None)


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable that sets `field` of a settings class."""
    alias = cls.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"{cls.model_config.get('env_prefix', '')}{field}".upper()


def load_from_env(cls: type[S]) -> S:
    """A settings object from the environment; a bad value exits naming the variable, why, and what is allowed."""
    try:
        return cls()
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            name = env_name(cls, field) if field in cls.model_fields else cls.__name__
            lines.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
        raise SystemExit("invalid settings:\n  " + "\n  ".join(lines)) from None


def load_settings() -> Settings:
    """The platform settings from the environment (call once at start, then pass the object on)."""
    return load_from_env(Settings)
