"""The quality-gate reports stored with model versions (models.quality_gate, written by build-engines), as the
rollout rule, the admin API and the admin UI read them."""
from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from registry.queries import get_model_version

SUMMARY_KEYS = ("passed", "skipped", "skip_reason", "failures", "dtype", "metrics", "thresholds", "engine")


def gate_summary(report: dict[str, Any] | None) -> dict[str, Any]:
    """What an operator compares: verdict, numbers, thresholds and the eval set's hash (never the whole report).
    A version without a report (built before the gate existed, or registered by hand) says so."""
    if not report:
        return {"passed": False, "missing": True, "failures": ["no quality-gate report (not built by "
                                                                 "build-engines with the gate)"]}
    out = {k: report[k] for k in SUMMARY_KEYS if k in report}
    if "eval_set" in report:
        out["eval_set_sha256"] = report["eval_set"].get("sha256", "")
    return out


def gate_reports(session: Session, model: str, versions: list[str]) -> dict[str, dict[str, Any]]:
    """version -> gate_summary for each of `versions` that is registered."""
    out = {}
    for version in versions:
        row = get_model_version(session, model, version)
        if row is not None:
            out[version] = gate_summary(row.quality_gate)
    return out
