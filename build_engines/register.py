"""Registry side of a build: decide whether a build is new, a no-op or refused, and move the version's
row through building -> built -> staged (or failed, with the reason).

A version becomes routable only at `staged`; until then (and when failed) routers must not send it traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from registry.db import migrate, session_scope
from registry.queries import audit, get_model_version, routes_for, set_model_status, upsert_model_version

from build_engines.plan import BuildError

ACTOR = "build-engines"
DONE_STATUSES = ("built", "staged", "serving", "draining", "retired")


@dataclass(frozen=True)
class Existing:
    """What the registry already holds for (model, version)."""
    decision: Literal["new", "noop", "rebuild"]
    status: str = ""
    reason: str = ""


def check_existing(db_url: str, model: str, version: str, fingerprint: str, force: bool,
                   artefacts_ok: bool) -> Existing:
    """new: no row; noop: same inputs, finished, artefacts present; rebuild: allowed to build again.

    A finished version built from different inputs is refused unless `force`, and even then not while
    it receives traffic (its replicas read the files that a rebuild would replace).
    """
    with session_scope(db_url) as s:
        row = get_model_version(s, model, version)
        if row is None:
            return Existing("new")
        status, old = row.status, (row.build_info or {}).get("inputs_sha256", "")
        percent = routes_for(s, model).get(version, 0)
    if status in ("building", "failed"):
        return Existing("rebuild", status, "an earlier build did not finish")
    same = old == fingerprint
    if same and artefacts_ok and not force:
        return Existing("noop", status, "same inputs, artefacts present")
    if not same and not force:
        raise BuildError("--version", f"{model} version {version} already exists (status {status}) and was built "
                                      "from different inputs; pick a new version, or pass --force to rebuild it")
    if percent > 0:
        raise BuildError("--force", f"{model} version {version} receives {percent}% of traffic; route it to 0% "
                                    "before rebuilding it")
    return Existing("rebuild", status, "forced" if force else "artefacts missing")


class Registration:
    """The registry row of the version being built."""

    def __init__(self, db_url: str, model: str, version: str, do_migrate: bool = True) -> None:
        self.db_url, self.model, self.version = db_url, model, version
        if do_migrate:
            migrate(db_url)

    def begin(self, **fields: Any) -> None:
        """Create (or reset) the row as `building`; it is not routable in this state."""
        with session_scope(self.db_url) as s:
            upsert_model_version(s, self.model, self.version, status="building", status_reason="", **fields)
            audit(s, ACTOR, "build_started", f"{self.model}/{self.version}", None,
                  {k: v for k, v in fields.items() if k != "build_info"})

    def update(self, status: str, reason: str = "", **fields: Any) -> None:
        with session_scope(self.db_url) as s:
            upsert_model_version(s, self.model, self.version, **fields)
            set_model_status(s, self.model, self.version, status, reason)
            audit(s, ACTOR, f"build_{status}", f"{self.model}/{self.version}", None,
                  {"status": status, "reason": reason} | {k: _audited(k, v) for k, v in fields.items()
                                                            if k != "build_info"})

    def fail(self, reason: str, build_info: dict[str, Any] | None = None, **fields: Any) -> None:
        """Mark the version failed with `reason` (and `fields`, e.g. the quality-gate report); never raises (it
        runs while handling another error)."""
        try:
            if build_info is not None:
                fields["build_info"] = build_info
            self.update("failed", reason[:2000], **fields)
        except Exception as exc:  # noqa: BLE001 - the original error matters more
            from build_engines.stage import console
            console.print(f"[red]could not record the failure in the registry: {exc}[/red]")


def _audited(key: str, value: Any) -> Any:
    """The audit row keeps the gate's verdict and numbers, not the whole report."""
    if key == "quality_gate" and isinstance(value, dict):
        return {k: value.get(k) for k in ("passed", "skipped", "skip_reason", "metrics", "failures") if k in value}
    return value


def read_row(db_url: str, model: str, version: str) -> dict[str, Any] | None:
    """The version's row as a plain dict (for output and tests)."""
    with session_scope(db_url) as s:
        row = get_model_version(s, model, version)
        if row is None:
            return None
        return {c: getattr(row, c) for c in ("name", "version", "weights_uri", "dtype", "tensor_parallel",
                                             "max_context", "engine_kind", "status", "status_reason",
                                             "repository_path", "build_info", "quality_gate")}
