"""What a caller may see and reach: models, versions and adapters, for requests and for listings.

One set of rules for every door (HTTP `/v1/models`, KServe ModelMetadata / ModelReady / RepositoryIndex, the
request path), so nothing one door hides leaks through another:
- a caller sees only its allowed models (`callers.allowed_models`, empty = all); any other model answers
  "not found" exactly like a model that does not exist, and errors never list models it may not use;
- an explicit `version` reaches only versions that take traffic (routed > 0 %, or status `serving`), unless
  the caller has `canary_access`: a staged 0 % canary stays dark to everyone else;
- an adapter must be the caller's team's (or in `allowed_adapters`), `ready`, and for this model; a request
  with an adapter runs on the adapter's base version; errors list only adapters the caller may use.
"""
from __future__ import annotations

from collections.abc import Callable

from common.names import ADAPTER_NAME_RULE, valid_adapter_name
from router_service.errors import RouterError, invalid
from router_service.registry_cache import AdapterInfo, CallerInfo, ModelInfo, Snapshot
from router_service.request import TIERS, GenerateRequest
from router_service.rollout import pick_version


def _short(value: str) -> str:
    return repr(value[:64] + ("..." if len(value) > 64 else ""))


def visible_models(snap: Snapshot, caller: CallerInfo) -> dict[str, dict[str, ModelInfo]]:
    """Model -> the versions this caller may name explicitly."""
    out = {}
    for name, versions in snap.models.items():
        if caller.allowed_models and name not in caller.allowed_models:
            continue
        pinnable = {v: info for v, info in versions.items() if may_pin(snap, caller, name, v)}
        if pinnable or snap.routes.get(name):
            out[name] = pinnable
    return out


def may_pin(snap: Snapshot, caller: CallerInfo, model: str, version: str) -> bool:
    info = snap.models.get(model, {}).get(version)
    if info is None:
        return False
    return caller.canary_access or snap.routes.get(model, {}).get(version, 0) > 0 or info.status == "serving"


def usable_adapters(snap: Snapshot, caller: CallerInfo, model: str) -> list[str]:
    return sorted(a.name for a in snap.adapters.values() if a.base_model == model and _owns(caller, a))


def _owns(caller: CallerInfo, adapter: AdapterInfo) -> bool:
    return adapter.owner_team == caller.team or adapter.name in caller.allowed_adapters


def resolve_model(snap: Snapshot, caller: CallerInfo, req: GenerateRequest,
                  shares: Callable[[], dict[str, float]] | None = None) -> ModelInfo:
    """The model version `req` runs on for `caller`, or the RouterError that explains why none.

    `shares` gives the split as it stands now (a version without ready replicas keeps its share pending,
    see rollout.py); without it the configured split is used."""
    versions = snap.models.get(req.model)
    if not versions or (caller.allowed_models and req.model not in caller.allowed_models):
        known = ", ".join(sorted(visible_models(snap, caller))) or "none"
        raise RouterError("not_found", f"model: {_short(req.model)} is not served to caller {caller.name!r}; "
                                       f"models you may use: {known}")
    if req.tier in TIERS and TIERS.index(req.tier) < TIERS.index(caller.max_tier):
        raise RouterError("permission_denied",
                          f"priority {req.tier!r} is above caller {caller.name!r}'s maximum tier {caller.max_tier!r}")
    adapter = _resolve_adapter(snap, caller, req) if req.adapter else None
    if req.version:
        if not may_pin(snap, caller, req.model, req.version):
            pinnable = sorted(v for v in versions if may_pin(snap, caller, req.model, v))
            raise RouterError("not_found", f"version: model {req.model!r} has no version {_short(req.version)} "
                                           f"you may use; versions you may use: {', '.join(pinnable) or 'none'}")
        if adapter is not None and adapter.base_version != req.version:
            raise invalid("version", f"adapter {adapter.name!r} is built for version {adapter.base_version!r} of "
                                     f"{req.model!r}, not {req.version!r}; leave version out to use it")
        return versions[req.version]
    if adapter is not None:  # an adapter only fits the base weights it was trained on
        if adapter.base_version not in versions:
            raise RouterError("unavailable", f"adapter {adapter.name!r}: its base version {adapter.base_version!r} "
                                             f"of {req.model!r} is not served")
        return versions[adapter.base_version]
    split = snap.routes.get(req.model)
    if not split:
        raise RouterError("unavailable", f"model {req.model!r} has no route; an operator must set one")
    return versions[pick_version(shares() if shares is not None else split, req.session or caller.name)]


def _resolve_adapter(snap: Snapshot, caller: CallerInfo, req: GenerateRequest) -> AdapterInfo:
    if not valid_adapter_name(req.adapter):
        raise invalid("adapter", f"{_short(req.adapter)} is not an adapter name; allowed: {ADAPTER_NAME_RULE}")
    adapter = snap.adapters.get(req.adapter)
    if adapter is None or adapter.base_model != req.model or not _owns(caller, adapter):
        if adapter is not None and adapter.base_model == req.model:
            # it exists but is another team's: say so without naming the team or its other adapters
            raise RouterError("permission_denied", f"adapter: {_short(req.adapter)} does not belong to team "
                                                   f"{caller.team!r} of caller {caller.name!r}")
        known = usable_adapters(snap, caller, req.model)
        raise RouterError("not_found", f"adapter: {_short(req.adapter)} does not exist for model {req.model!r}; "
                                       f"adapters you may use: {', '.join(known) or 'none'}")
    if adapter.status != "ready":
        raise RouterError("unavailable", f"adapter: {adapter.name!r} is {adapter.status!r}, not ready")
    return adapter
