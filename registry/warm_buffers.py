"""Warm-buffer and replica-bound settings per model version, written through the admin API (audited).

A warm buffer is the number of idle replicas kept ready for bursts (`min_idle_replicas`); the autoscaler
keeps each model version between `min_replicas` and `max_replicas` and scales on its SLO targets.
"""
from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, all_routes, audit, bump_version, get_model_version, upsert
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


@dataclass(frozen=True)
class PoolSettings:
    """The scaling settings in force for one model version: its own warm-buffer row, or (for a routed
    version without one) the row it inherits from its model; `inherited_from` names that version."""
    model: str
    version: str
    min_idle_replicas: int
    min_replicas: int
    max_replicas: int
    slo_ttft_ms_p95: int
    slo_tokens_per_s: int
    routed_percent: int = 0
    inherited_from: str | None = None

    @property
    def own_row(self) -> bool:
        return self.inherited_from is None


def managed_pools(session: Session) -> list[PoolSettings]:
    """Every model version the autoscaler manages: each warm-buffer row, plus each routed version without
    one. A routed version without a row inherits its model's settings (the row of the routed version
    with the largest percent, else the model's newest row, else the table defaults) so a rollout to a
    fresh version gets capacity before traffic (the router shifts traffic only as replicas get ready)."""
    rows = {(wb.model, wb.version): wb for wb in session.scalars(select(WarmBuffer))}
    routes = all_routes(session)
    out = [_settings(wb, routes.get(wb.model, {}).get(wb.version, 0)) for wb in rows.values()]
    for model, split in routes.items():
        for version, percent in split.items():
            if (model, version) in rows:
                continue
            donor = _donor(model, split, rows)
            if donor is None:
                defaults = {f: WarmBuffer.__table__.c[f].default.arg for f in FIELDS}
                out.append(PoolSettings(model, version, **defaults, routed_percent=percent, inherited_from="defaults"))
            else:
                base = _settings(donor, percent)
                out.append(PoolSettings(**{**base.__dict__, "version": version, "inherited_from": donor.version}))
    return sorted(out, key=lambda p: (p.model, p.version))


def _settings(wb: WarmBuffer, percent: int) -> PoolSettings:
    return PoolSettings(wb.model, wb.version, wb.min_idle_replicas, wb.min_replicas, wb.max_replicas,
                        wb.slo_ttft_ms_p95, wb.slo_tokens_per_s, percent)


def _donor(model: str, split: dict[str, int], rows: dict[tuple[str, str], WarmBuffer]) -> WarmBuffer | None:
    routed = sorted((p, v) for v, p in split.items() if (model, v) in rows)
    if routed:
        return rows[(model, routed[-1][1])]
    own = sorted(v for m, v in rows if m == model)
    return rows[(model, own[-1])] if own else None
