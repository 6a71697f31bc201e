"""Registry and fleet data for the admin UI pages (the pages themselves only lay out what these return).

Reads go straight to the registry (read-only); the router's `/admin/fleet` answer is turned into frames
here too. Writes never happen here: they go through `admin_ui.router_client`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

import pandas as pd

from common.settings import load_settings
from registry import queries
from registry.db import session_scope
from registry.warm_buffers import warm_buffer_problems

DEFAULT_SLO_TTFT_MS = 500  # interactive tier (docs/architecture.md, Goals) when a version has no warm-buffer row
DEFAULT_SLO_TOKENS_PER_S = 40
FLEET_COLUMNS = ["replica_id", "model", "version", "region", "state", "reporting", "inflight", "kv_utilisation",
                 "running", "waiting", "queue_wait_ms_p95", "ttft_ms_p95", "slo_ttft_ms_p95", "meets_slo",
                 "tokens_per_s"]

DECISION_COLUMNS = ["at", "pool", "serving", "starting", "desired", "why"]
# the replica table's column order on the page: the numbers an operator scans first
FLEET_VIEW_ORDER = ["replica_id", "version", "state", "kv_utilisation", "waiting", "queue_wait_ms_p95", "ttft_ms_p95",
                    "slo_ttft_ms_p95", "meets_slo", "tokens_per_s", "running", "inflight", "model", "region",
                    "reporting"]


def _db(db_url: str | None) -> str:
    return db_url or load_settings().db_url


def models_frame(db_url: str | None = None) -> pd.DataFrame:
    """One row per model version: status, context length and its share of traffic."""
    with session_scope(_db(db_url)) as s:
        rows = [{"model": m.name, "version": m.version, "status": m.status, "max_context": m.max_context,
                 "route_percent": m.percent} for m in queries.model_summaries(s)]
    return pd.DataFrame(rows, columns=["model", "version", "status", "max_context", "route_percent"])


def versions_frame(db_url: str | None = None) -> pd.DataFrame:
    """Every registered model version with status, build info and its current route percent."""
    cols = ["model", "version", "status", "route_percent", "engine_kind", "dtype", "tensor_parallel",
            "max_context", "created_at", "status_reason", "build_info"]
    with session_scope(_db(db_url)) as s:
        routes = queries.all_routes(s)
        rows = [{"model": m.name, "version": m.version, "status": m.status,
                 "route_percent": routes.get(m.name, {}).get(m.version, 0), "engine_kind": m.engine_kind,
                 "dtype": m.dtype, "tensor_parallel": m.tensor_parallel, "max_context": m.max_context,
                 "created_at": m.created_at, "status_reason": m.status_reason or "",
                 "build_info": _compact(m.build_info)} for m in queries.list_model_versions(s)]
    return pd.DataFrame(rows, columns=cols)


def routes(db_url: str | None = None) -> dict[str, dict[str, int]]:
    """model -> {version: percent} for the versions that get traffic."""
    with session_scope(_db(db_url)) as s:
        return queries.all_routes(s)


def warm_buffers_frame(db_url: str | None = None) -> pd.DataFrame:
    """Warm-buffer settings and SLO targets, one row per model version."""
    cols = ["model", "version", "min_idle_replicas", "min_replicas", "max_replicas", "slo_ttft_ms_p95",
            "slo_tokens_per_s"]
    with session_scope(_db(db_url)) as s:
        rows = [{c: getattr(b, c) for c in cols} for b in queries.list_warm_buffers(s)]
    return pd.DataFrame(rows, columns=cols).sort_values(["model", "version"]).reset_index(drop=True)


def slo_targets(db_url: str | None = None) -> dict[tuple[str, str], tuple[int, int]]:
    """(model, version) -> (TTFT p95 target ms, tokens/s target) from the warm-buffer rows."""
    frame = warm_buffers_frame(db_url)
    return {(r.model, r.version): (int(r.slo_ttft_ms_p95), int(r.slo_tokens_per_s)) for r in frame.itertuples()}


def registry_replicas(db_url: str | None = None) -> list[dict]:
    """Replicas as registered (used when the router, and so live state, is unreachable)."""
    with session_scope(_db(db_url)) as s:
        return [{"replica_id": r.replica_id, "model": r.model, "version": r.version, "region": r.region,
                 "state": r.state, "reporting": False} for r in queries.list_replicas(s)]


def registry_audit(db_url: str | None = None, limit: int = 100) -> list[dict]:
    """The audit log read from the registry (same shape as the router's `/admin/audit` entries)."""
    with session_scope(_db(db_url)) as s:
        return [{"at": a.at.isoformat(), "actor": a.actor, "action": a.action, "target": a.target,
                 "before": a.before, "after": a.after} for a in queries.list_audit(s, limit)]


def audit_frame(entries: Iterable[dict]) -> pd.DataFrame:
    """Audit entries as a table with before/after shown as compact JSON."""
    rows = [{"at": e.get("at"), "actor": e.get("actor"), "action": e.get("action"), "target": e.get("target"),
             "before": _compact(e.get("before")), "after": _compact(e.get("after"))} for e in entries]
    return pd.DataFrame(rows, columns=["at", "actor", "action", "target", "before", "after"])


def fleet_frame(replicas: list[dict], slos: dict[tuple[str, str], tuple[int, int]] | None = None) -> pd.DataFrame:
    """The router's replica list as one row per replica with KV utilisation and TTFT p95 against the SLO."""
    slos = slos or {}
    rows = []
    for r in replicas:
        total, free = r.get("kv_blocks_total"), r.get("kv_blocks_free")
        kv = (1.0 - free / total) if total and free is not None else None
        slo = slos.get((r.get("model"), r.get("version")), (DEFAULT_SLO_TTFT_MS, DEFAULT_SLO_TOKENS_PER_S))[0]
        ttft = r.get("ttft_ms_p95")
        rows.append({"replica_id": r.get("replica_id"), "model": r.get("model"), "version": r.get("version"),
                     "region": r.get("region"), "state": r.get("state"), "reporting": bool(r.get("reporting")),
                     "inflight": r.get("inflight", 0), "kv_utilisation": kv, "running": r.get("running"),
                     "waiting": r.get("waiting"), "queue_wait_ms_p95": r.get("queue_wait_ms_p95"),
                     "ttft_ms_p95": ttft, "slo_ttft_ms_p95": slo,
                     "meets_slo": None if ttft is None else bool(ttft <= slo), "tokens_per_s": r.get("tokens_per_s")})
    frame = pd.DataFrame(rows, columns=FLEET_COLUMNS)
    for col in ("inflight", "kv_utilisation", "running", "waiting", "queue_wait_ms_p95", "ttft_ms_p95", "tokens_per_s"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame


def fleet_rollup(frame: pd.DataFrame) -> pd.DataFrame:
    """Replicas per model / version / region and state, with summed queue and tokens/s."""
    cols = ["model", "version", "region", "serving", "draining", "cordoned", "other", "waiting", "tokens_per_s"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    f = frame.assign(bucket=frame["state"].where(frame["state"].isin(["serving", "draining", "cordoned"]), "other"))
    counts = pd.crosstab([f["model"], f["version"], f["region"]], f["bucket"])
    for state in ("serving", "draining", "cordoned", "other"):
        if state not in counts:
            counts[state] = 0
    sums = f.groupby(["model", "version", "region"])[["waiting", "tokens_per_s"]].sum(min_count=1)
    out = counts[["serving", "draining", "cordoned", "other"]].join(sums).reset_index()
    return out[cols]


def validate_warm_buffer(values: dict[str, int]) -> dict[str, str]:
    """Field -> problem for warm-buffer settings (the same rules the registry applies)."""
    return warm_buffer_problems(**values)


def _compact(value) -> str:
    if value in (None, {}, []):
        return ""
    return json.dumps(value, sort_keys=True, default=str)


def append_sample(history: list[dict], frame: pd.DataFrame, at, keep: int = 120) -> list[dict]:
    """Add one fleet-wide sample (tokens/s, waiting) to a rolling history of at most `keep` samples."""
    sample = {"at": at, "tokens_per_s": float(pd.to_numeric(frame["tokens_per_s"], errors="coerce").sum()),
              "waiting": float(pd.to_numeric(frame["waiting"], errors="coerce").sum())}
    return [*history, sample][-keep:]


def autoscaler_decisions(data_dir, limit: int = 50) -> pd.DataFrame:
    """Recent autoscaler decisions, newest first, from `<data dir>/autoscale/decisions.jsonl`: one JSON object
    a line, the controller's Decision (`ts` wall-clock seconds, `pool`, `serving`, `starting`, `desired`,
    `signals`: the numbers it decided on) plus an optional `reason`. Empty when none are recorded."""
    from pathlib import Path

    path = Path(data_dir) / "autoscale" / "decisions.jsonl"
    if not path.exists():
        return pd.DataFrame(columns=DECISION_COLUMNS)
    rows = []
    for line in path.read_text().splitlines()[-limit:]:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        ts = d.get("ts")
        rows.append({"at": pd.to_datetime(ts, unit="s", utc=True) if isinstance(ts, (int, float)) else None,
                     "pool": d.get("pool") or "/".join(str(d[k]) for k in ("model", "version") if d.get(k)),
                     "serving": d.get("serving", d.get("current")), "starting": d.get("starting"),
                     "desired": d.get("desired"), "why": d.get("reason") or _compact(d.get("signals"))})
    return pd.DataFrame(rows[::-1], columns=DECISION_COLUMNS)
