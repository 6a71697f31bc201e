"""Where the usage tables live: Delta Lake tables (Parquet + a transaction log, via delta-rs `deltalake`)
under one base URI, a local directory (`make up`) or an object store (`s3://bucket/prefix`, any
S3-compatible server), read by DuckDB through Arrow datasets.

Tables under the base URI:
- `events/`: one row per stored usage event, partitioned by `day` (UTC date of ts); besides the
  `UsageEvent` columns (trace_id null for events from before it existed) each row carries `load_writer`, `load_seq` (the loader batch that wrote it) and
  `loaded_at` (unix s), which the loader uses for exactly-once and de-duplication.
- `rollups_hourly/`: partial hourly aggregates (see usage/rollups.py), partitioned by `day`; readers sum.
- `rejects/`: events the loader refused, with the reason.

Why Delta: every commit is atomic and versioned, so a reader pins one snapshot and never sees half a batch
and never blocks the writer; a commit can carry an application transaction `(app_id, version)` in the same
log entry as its data, which is how the loader makes each batch idempotent (usage/loader.py). Any number
of readers on any node read the same URI; writers on S3 need conditional put (`FLEET_USAGE_LAKE_CONDITIONAL_PUT=etag`,
S3 / MinIO / R2) or a single writer (`FLEET_USAGE_LAKE_UNSAFE_RENAME=true`, the loader's default shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import TableNotFoundError
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

EVENTS, ROLLUPS, REJECTS = "events", "rollups_hourly", "rejects"

EVENT_FIELDS = [
    ("request_id", pa.string()), ("ts", pa.float64()), ("caller", pa.string()), ("team", pa.string()),
    ("model", pa.string()), ("version", pa.string()), ("adapter", pa.string()), ("priority", pa.string()),
    ("region", pa.string()), ("replica_id", pa.string()), ("prompt_tokens", pa.int64()),
    ("cached_prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("ttft_ms", pa.float64()),
    ("duration_ms", pa.float64()), ("finish_reason", pa.string()), ("status", pa.string())]
# Nullable event columns added after the first tables were written (`append` evolves an older table).
OPTIONAL_EVENT_FIELDS = [("trace_id", pa.string())]
EVENTS_SCHEMA = pa.schema(EVENT_FIELDS + OPTIONAL_EVENT_FIELDS + [("day", pa.date32()), ("load_writer", pa.string()),
                                          ("load_seq", pa.int64()), ("loaded_at", pa.float64())])
ROLLUP_DIMS = ["team", "caller", "model", "version", "adapter", "priority", "region"]
ROLLUP_SUMS = ["requests", "errors", "cancelled", "prefill_tokens", "cached_tokens", "decode_tokens",
               "ttft_ms_sum", "duration_ms_sum"]
ROLLUPS_SCHEMA = pa.schema([("day", pa.date32()), ("hour", pa.float64())]
                           + [(d, pa.string()) for d in ROLLUP_DIMS]
                           + [(s, pa.float64() if s.endswith("_ms_sum") else pa.int64()) for s in ROLLUP_SUMS])
REJECTS_SCHEMA = pa.schema([("id", pa.string()), ("rejected_at", pa.timestamp("us", tz="UTC")), ("reason", pa.string()),
                            ("raw", pa.string()), ("load_writer", pa.string()), ("load_seq", pa.int64())])
SCHEMAS = {EVENTS: EVENTS_SCHEMA, ROLLUPS: ROLLUPS_SCHEMA, REJECTS: REJECTS_SCHEMA}
PARTITIONS = {EVENTS: ["day"], ROLLUPS: ["day"], REJECTS: []}


class LakeSettings(BaseSettings):
    """FLEET_USAGE_LAKE_URI (default: `<store file>.lake` beside the DuckDB control file) and, for s3://
    URIs, the usual AWS_* variables (from a Secret in deploy/)."""
    model_config = SettingsConfigDict(env_prefix="FLEET_", frozen=True, extra="ignore")

    usage_lake_uri: str = Field("", max_length=1000)
    usage_lake_allow_http: bool = False          # an in-cluster MinIO / a local test server without TLS
    usage_lake_conditional_put: str = ""         # "etag": safe concurrent writers on S3-compatible stores
    usage_lake_unsafe_rename: bool = True        # one writer per table (the loader): no lock service needed
    aws_endpoint_url: str = Field("", validation_alias=AliasChoices("AWS_ENDPOINT_URL"))
    aws_access_key_id: str = Field("", validation_alias=AliasChoices("AWS_ACCESS_KEY_ID"))
    aws_secret_access_key: str = Field("", validation_alias=AliasChoices("AWS_SECRET_ACCESS_KEY"))
    aws_region: str = Field("us-east-1", validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION"))

    def storage_options(self) -> dict[str, str]:
        opts = {"AWS_REGION": self.aws_region}
        for key, value in (("AWS_ENDPOINT_URL", self.aws_endpoint_url), ("AWS_ACCESS_KEY_ID", self.aws_access_key_id),
                           ("AWS_SECRET_ACCESS_KEY", self.aws_secret_access_key),
                           ("AWS_CONDITIONAL_PUT", self.usage_lake_conditional_put)):
            if value:
                opts[key] = value
        if self.usage_lake_allow_http:
            opts["AWS_ALLOW_HTTP"] = "true"
        if self.usage_lake_unsafe_rename and not self.usage_lake_conditional_put:
            opts["AWS_S3_ALLOW_UNSAFE_RENAME"] = "true"
        return opts


@dataclass(frozen=True)
class Lake:
    """One base URI plus the object-store options (credentials, endpoint) delta-rs needs for it."""
    uri: str
    storage_options: dict[str, str] = field(default_factory=dict)

    def table_uri(self, table: str) -> str:
        return f"{self.uri.rstrip('/')}/{table}"

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri or self.uri.startswith("file://")

    def exists(self) -> bool:
        return DeltaTable.is_deltatable(self.table_uri(EVENTS), storage_options=self.storage_options or None)


_settings: LakeSettings | None = None


def lake_for(store_path: Path, settings: LakeSettings | None = None) -> Lake:
    """The lake that goes with a DuckDB control file: FLEET_USAGE_LAKE_URI when set (production: one object
    store for every node), else the directory `<store>.lake` beside the file (the embedded default)."""
    global _settings
    if settings is None:
        if _settings is None:
            from common.settings import load_from_env
            _settings = load_from_env(LakeSettings)
        settings = _settings
    if settings.usage_lake_uri:
        return Lake(settings.usage_lake_uri, settings.storage_options())
    return Lake(str(Path(store_path).with_suffix(".lake").resolve()))


def open_table(lake: Lake, table: str) -> DeltaTable | None:
    """The table's latest snapshot, or None before its first commit."""
    try:
        return DeltaTable(lake.table_uri(table), storage_options=lake.storage_options or None)
    except TableNotFoundError:
        return None


def txn_version(lake: Lake, table: str, app_id: str) -> int:
    """The last version committed by application `app_id` into `table`; -1 when none."""
    dt = open_table(lake, table)
    if dt is None:
        return -1
    got = dt.transaction_version(app_id)
    return -1 if got is None else int(got)


def append(lake: Lake, table: str, data: pa.Table, txn: tuple[str, int] | None = None,
           metadata: dict[str, str] | None = None) -> None:
    """One atomic Delta commit adding `data` to `table` (created on first use). `txn` = (app_id, version) is
    written in the same commit, so whoever reads the version back knows the data is in."""
    props = CommitProperties(custom_metadata=metadata,
                             app_transactions=[Transaction(app_id=txn[0], version=txn[1])] if txn else None)
    # schema_mode="merge": a table written before a column was added (trace_id) gains it in this same
    # commit (older files read it as null); columns are matched by name, so the order may differ.
    write_deltalake(lake.table_uri(table), data.cast(SCHEMAS[table]), mode="append",
                    partition_by=PARTITIONS[table] or None, storage_options=lake.storage_options or None,
                    commit_properties=props, schema_mode="merge" if table == EVENTS else None)


def dataset(lake: Lake, table: str):
    """A pyarrow dataset of the table's latest snapshot (an empty table before the first commit). DuckDB
    scans it with filter and projection push-down; partitions (`day`) are pruned."""
    dt = open_table(lake, table)
    if dt is None:
        return SCHEMAS[table].empty_table()
    return dt.to_pyarrow_dataset()


def register_views(con, lake: Lake) -> None:
    """Make usage_events, usage_rollups and usage_rejects queryable on a DuckDB connection. Each is one
    pinned snapshot: a batch committed while the query runs is not half-seen; the next connect sees it."""
    con.register("usage_events", dataset(lake, EVENTS))
    con.register("usage_rollups", dataset(lake, ROLLUPS))
    con.register("usage_rejects", dataset(lake, REJECTS))
