"""Warm-buffer and replica-bound settings per model version, written through the admin API (audited).

A warm buffer is the number of idle replicas kept ready for bursts (`min_idle_replicas`); the autoscaler
keeps each model version between `min_replicas` and `max_replicas` and scales on its SLO targets.
"""
from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version, get_model_version, upsert
from registry.schema import WarmBuffer

FIELDS = ("min_idle_replicas", "min_replicas", "max_replicas", "slo_ttft_ms_p95", "slo_tokens_per_s")


def warm_buffer_problems(min_idle_replicas: int, min_replicas: int, max_replicas: int,
                         slo_ttft_ms_p95: int, slo_tokens_per_s: int) -> dict[str, str]:
    """Field -> what is wrong with it; empty when the settings are valid. Shared by the API and the UI."""
    values = dict(min_idle_replicas=min_idle_replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                  slo_ttft_ms_p95=slo_ttft_ms_p95, slo_tokens_per_s=slo_tokens_per_s)
    problems: dict[str, str] = {}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            problems[name] = f"{name} must be a whole number, got {value!r}"
        elif value < 0:
            problems[name] = f"{name} is {value}; it must be 0 or more"
    if problems:
        return problems
    if min_replicas > max_replicas:
        problems["min_replicas"] = f"min_replicas ({min_replicas}) is greater than max_replicas ({max_replicas})"
    if min_idle_replicas > max_replicas:
        problems["min_idle_replicas"] = (f"min_idle_replicas ({min_idle_replicas}) is greater than "
                                         f"max_replicas ({max_replicas})")
    if slo_ttft_ms_p95 == 0:
        problems["slo_ttft_ms_p95"] = "slo_ttft_ms_p95 must be above 0 ms"
    return problems


def get_warm_buffer(session: Session, model: str, version: str) -> WarmBuffer | None:
    return session.scalar(select(WarmBuffer).where(WarmBuffer.model == model, WarmBuffer.version == version))


def set_warm_buffer(session: Session, model: str, version: str, min_idle_replicas: int, min_replicas: int,
                    max_replicas: int, slo_ttft_ms_p95: int, slo_tokens_per_s: int, actor: str) -> dict[str, int]:
    """Create or replace the warm-buffer row of a known model version; refuses bad input with a
    RegistryError naming the field. Adds an audit row and bumps the registry version."""
    values = dict(min_idle_replicas=min_idle_replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                  slo_ttft_ms_p95=slo_ttft_ms_p95, slo_tokens_per_s=slo_tokens_per_s)
    problems = warm_buffer_problems(**values)
    if problems:
        raise RegistryError("; ".join(problems.values()))
    if get_model_version(session, model, version) is None:
        raise RegistryError(f"model {model!r} has no version {version!r}")
    row = get_warm_buffer(session, model, version)
    before = {f: getattr(row, f) for f in FIELDS} if row is not None else None
    if before == values:
        return values  # nothing changes: no audit row
    upsert(session, row, lambda: WarmBuffer(model=model, version=version, **values), values)
    audit(session, actor, "set_warm_buffer", f"{model}/{version}", before, values)
    bump_version(session)
    return values
