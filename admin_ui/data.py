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


GATE_COLUMNS = ["version", "status", "route_percent", "gate", "agreement", "mean_abs_logprob_delta",
                "max_abs_logprob_delta", "ppl_engine", "ppl_reference", "dtype", "thresholds", "eval_set", "why"]


def quality_gate_frame(model: str, db_url: str | None = None) -> pd.DataFrame:
    """The model's versions side by side with their build-time quality gate (build_engines.quality_gate):
    verdict, numbers, the thresholds they were held to and the eval set's hash; the serving version's row next
    to the candidate's is what an operator compares before ramping (router_service.rollout's rule)."""
    from registry.quality import gate_summary

    with session_scope(_db(db_url)) as s:
        split = queries.routes_for(s, model)
        rows = []
        for m in queries.list_model_versions(s):
            if m.name != model or m.status not in (*queries.ROUTABLE_STATUSES, "failed"):
                continue
            g, metrics = gate_summary(m.quality_gate), (m.quality_gate or {}).get("metrics", {})
            verdict = "skipped" if g.get("skipped") else "missing" if g.get("missing") else \
                "passed" if g["passed"] else "FAILED"
            rows.append({"version": m.version, "status": m.status, "route_percent": split.get(m.version, 0),
                         "gate": verdict, **{k: metrics.get(k) for k in GATE_COLUMNS[4:9]},
                         "dtype": g.get("dtype", m.dtype), "thresholds": _compact(g.get("thresholds") or {}),
                         "eval_set": (g.get("eval_set_sha256") or "")[:12],
                         "why": "; ".join(g.get("failures") or [])})
    return pd.DataFrame(rows, columns=GATE_COLUMNS)


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
    """Audit entries as a table: time in UTC (zone shown), the actor exactly as stored, a readable summary of
    the change, and before/after as full JSON."""
    rows = [{"at (UTC)": _utc_text(e.get("at")), "actor": e.get("actor"), "action": e.get("action"),
             "target": e.get("target"), "change": change_text(e.get("before"), e.get("after")),
             "before": _compact(e.get("before")), "after": _compact(e.get("after"))} for e in entries]
    return pd.DataFrame(rows, columns=["at (UTC)", "actor", "action", "target", "change", "before", "after"])


def _utc_text(at) -> str:
    if not at:
        return ""
    stamp = pd.Timestamp(at)
    stamp = stamp.tz_localize("UTC") if stamp.tzinfo is None else stamp.tz_convert("UTC")
    return f"{stamp:%Y-%m-%d %H:%M:%S} UTC"


def change_text(before: dict | None, after: dict | None) -> str:
    """'v1 100 % -> 90 %, v2 0 % -> 10 %' for route changes; 'field: old -> new' for other changes."""
    before, after = before or {}, after or {}
    if "routes" in before or "routes" in after:
        old, new = before.get("routes") or {}, after.get("routes") or {}
        parts = [f"v{v} {old.get(v, 0)} % → {new.get(v, 0)} %" for v in sorted(set(old) | set(new))]
        extra = f" ({after['reason']})" if after.get("reason") else ""
        return ", ".join(parts) + extra
    keys = [k for k in dict.fromkeys([*before, *after]) if before.get(k) != after.get(k)]
    return ", ".join(f"{k}: {_plain(before.get(k, '–'))} → {_plain(after.get(k, '–'))}" for k in keys)


def _plain(value) -> str:
    """Numbers as people write them (0.000001, not 1e-06)."""
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") if value != int(value) else f"{value:.0f}"
    return str(value)


def routable_versions(versions: pd.DataFrame, model: str) -> list[str]:
    """Versions of `model` that may take traffic (the registry refuses the others)."""
    rows = versions[(versions["model"] == model) & versions["status"].isin(queries.ROUTABLE_STATUSES)]
    return list(rows["version"])


def preview_split(current: dict[str, int], version: str, percent: int) -> tuple[dict[str, int] | None, str]:
    """The split the router would set for {version, percent} (same rule), or (None, the registry's refusal)."""
    try:
        return queries.rollout_split(current, version, percent), ""
    except queries.RegistryError as exc:
        return None, str(exc)


def split_preview_frame(current: dict[str, int], new: dict[str, int]) -> pd.DataFrame:
    versions = sorted(set(current) | set(new))
    return pd.DataFrame({"version": versions, "now %": [current.get(v, 0) for v in versions],
                         "after %": [new.get(v, 0) for v in versions]})


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
