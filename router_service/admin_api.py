"""Admin HTTP API: the one validated write path for rollouts and replica states, each change audited.

Rollout answers (and `GET /admin/fleet`'s `rollouts`) say what traffic each version gets now: a version
without ready replicas keeps its share pending ("v2: 0 of 1 replicas ready, 20 % pending") while the
autoscaler starts its replicas, and the versions that serve carry it meanwhile.

Who may call it: holders of a named admin token (registry/admin_tokens.py; `fleet admin-token create`), role
`operator` (may write) or `viewer` (read only). Tokens are checked against their hashes in constant time and
the audit log records the token's name as the actor. A change the registry refuses is a 400 with its reason.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from registry import queries
from registry.admin_tokens import AdminIdentity
from registry.db import session_scope
from registry.quality import gate_reports
from registry.warm_buffers import set_warm_buffer
from router_service.admin_budgets_rules import register_budget_and_rule_routes
from router_service.core import Router
from router_service.errors import RouterError
from router_service.http_security import admin_identity
from router_service.rollout import DEFAULT_GATE_PERCENT, ramp_gate_problems


OVERRIDE_FIELD = Field(default=None, min_length=10, max_length=500,
                       description="operator's reason to ramp past the gated percentage without a passed quality "
                                   "gate; recorded in the audit log (action quality_gate_override)")


class RolloutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | None = None
    percent: int | None = Field(default=None, ge=0, le=100)
    split: dict[str, int] | None = None
    override_quality_gate: str | None = OVERRIDE_FIELD


class WarmBufferBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_idle_replicas: int
    min_replicas: int
    max_replicas: int
    slo_ttft_ms_p95: int
    slo_tokens_per_s: int


class VersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str
    override_quality_gate: str | None = OVERRIDE_FIELD


def admin_router(router: Router) -> APIRouter:
    api = APIRouter(prefix="/admin")
    db_url = router.registry.db_url

    def identity(request: Request, need: str) -> AdminIdentity:
        # the same check http_security.AdminGate made before the body was read (the handler needs the name)
        return admin_identity(router.registry.snapshot.admin_tokens, request.headers, need)

    def role_of(request: Request, need: str) -> str:
        """The acting token's name (the audit log's actor)."""
        return identity(request, need).name

    async def write(fn, *args):
        try:
            result = await asyncio.to_thread(_in_session, db_url, fn, *args)
        except queries.RegistryError as exc:
            raise RouterError("invalid_argument", str(exc)) from exc
        router.registry.snapshot = await asyncio.to_thread(_reload, db_url)  # this router sees it at once
        return result

    @api.get("/whoami")
    async def whoami(request: Request):
        who = identity(request, "viewer")
        return {"role": who.role, "name": who.name}

    @api.get("/fleet")
    async def fleet(request: Request):
        role_of(request, "viewer")
        snap = router.registry.snapshot
        replicas = [{"replica_id": r.replica_id, "model": r.model, "version": r.version, "region": r.region,
                     "state": "cordoned" if r.replica_id in router.cordoned else r.state,
                     "inflight": router.inflight.get(r.replica_id, 0),
                     "load_tokens": round(router.chooser.load.get(r.replica_id, 0.0)),
                     **router.replica_state.summary(r.replica_id)}
                    for r in snap.replicas]
        queues = {name: {"waiting": len(q.waiting), "retry_after_ms": q.retry_after_ms(), "by_tier": q.tier_counts(),
                         "batch_deadline_ms": q.earliest_deadline_ms("batch")}
                  for name, q in router.queues.items()}
        rollouts = {model: rollout_status(model) for model in snap.routes}
        return {"registry_version": snap.version, "routes": snap.routes, "replicas": replicas, "queues": queues,
                "rollouts": rollouts}

    def rollout_status(model: str) -> dict:
        """The configured split, what each version gets now, and why (in the router's own region)."""
        ready = router.readiness(model, router.region)
        return {"region": router.region, "effective": {r.version: r.effective for r in ready if r.effective},
                "versions": [{"version": r.version, "percent": r.percent, "ready": r.ready, "needed": r.needed,
                              "effective_percent": r.effective, "pending_percent": round(r.pending, 3),
                              "note": r.note()} for r in ready if r.percent or r.effective],
                "notes": [r.note() for r in ready if r.percent or r.effective]}

    gate_percent = getattr(router, "rollout_gate_percent", DEFAULT_GATE_PERCENT)

    def gated_routes(s, name: str, split: dict[str, int], actor: str, override: str | None) -> bool:
        """set_routes under the promotion rule (router_service.rollout.ramp_gate_problems): refused with the
        reason, or allowed by an operator's override that the audit log records next to the route change."""
        before = queries.routes_for(s, name)
        gates = gate_reports(s, name, list(split))
        if set(split) - set(gates):  # an unknown version: set_routes refuses it with the known versions
            return queries.set_routes(s, name, split, actor=actor)
        problems = ramp_gate_problems(before, split, gates, gate_percent)
        note = None
        if problems and not override:
            raise queries.RegistryError(
                "; ".join(problems) + f". Ramping past {gate_percent} % needs a passed quality gate "
                f"(build-engines runs it; GET /admin/models/{name}/rollout shows the reports), or an operator "
                "override: send override_quality_gate with the reason (audited)")
        if problems:
            note = {"quality_gate_override": {"reason": override, "problems": problems}}
            queries.audit(s, actor, "quality_gate_override", name, {"routes": before},
                          {"routes": {v: p for v, p in split.items() if p}, "reason": override,
                           "problems": problems, "gate_percent": gate_percent})
        return queries.set_routes(s, name, split, actor=actor, note=note)

    def quality(name: str) -> dict:
        """The gate reports of the versions that take (or are set to take) traffic, side by side."""
        snap = router.registry.snapshot
        versions = sorted(set(snap.routes.get(name, {})) | {v for v, m in snap.models.get(name, {}).items()
                                                            if m.status in queries.ROUTABLE_STATUSES})
        return {"gate_percent": gate_percent,
                "versions": _in_session(db_url, lambda s: gate_reports(s, name, versions))}

    @api.get("/models/{name}/rollout")
    async def rollout_view(name: str, request: Request):
        role_of(request, "viewer")
        snap = router.registry.snapshot
        if name not in snap.models:
            raise RouterError("not_found", f"model {name!r} is not registered; known models: "
                                           f"{', '.join(sorted(snap.models)) or 'none'}")
        gates = await asyncio.to_thread(quality, name)
        return {"model": name, "routes": snap.routes.get(name, {}), "rollout": rollout_status(name),
                "quality_gate": gates}

    @api.post("/models/{name}/rollout")
    async def rollout(name: str, body: RolloutBody, request: Request):
        actor = role_of(request, "operator")
        if body.split is not None:
            split = body.split
        elif body.version is not None and body.percent is not None:
            try:  # the registry's own refusal (e.g. no other version to take the rest) is a 400, not a 500
                split = queries.rollout_split(router.registry.snapshot.routes.get(name, {}), body.version,
                                              body.percent)
            except queries.RegistryError as exc:
                raise RouterError("invalid_argument", str(exc)) from exc
        else:
            raise RouterError("invalid_argument", "send {version, percent} or {split: {version: percent}}")
        changed = await write(lambda s: gated_routes(s, name, split, actor, body.override_quality_gate))
        return {"model": name, "routes": {v: p for v, p in split.items() if p}, "changed": changed,
                "rollout": rollout_status(name)}

    @api.post("/models/{name}/promote")
    async def promote(name: str, body: VersionBody, request: Request):
        actor = role_of(request, "operator")

        def do(s):
            gated_routes(s, name, {body.version: 100}, actor, body.override_quality_gate)
            queries.set_model_status(s, name, body.version, "serving")
        await write(do)
        return {"model": name, "routes": {body.version: 100}, "rollout": rollout_status(name)}

    @api.post("/models/{name}/rollback")
    async def rollback(name: str, request: Request):
        actor = role_of(request, "operator")
        routes = await write(lambda s: queries.rollback_routes(s, name, actor=actor))
        return {"model": name, "routes": routes, "rollout": rollout_status(name)}

    @api.put("/warm-buffers/{model}/{version}")
    async def warm_buffer(model: str, version: str, body: WarmBufferBody, request: Request):
        actor = role_of(request, "operator")
        values = await write(lambda s: set_warm_buffer(s, model, version, **body.model_dump(), actor=actor))
        return {"model": model, "version": version, **values}

    @api.post("/replicas/{replica_id}/{action}")
    async def replica_action(replica_id: str, action: str, request: Request):
        actor = role_of(request, "operator")
        state = {"cordon": "cordoned", "drain": "draining", "uncordon": "serving"}.get(action)
        if state is None:
            raise RouterError("not_found", f"unknown replica action {action!r}; allowed: cordon, drain, uncordon")
        await write(lambda s: queries.set_replica_state(s, replica_id, state, actor=actor))
        if state == "serving":
            router.cordoned.pop(replica_id, None)
        return {"replica_id": replica_id, "state": state}

    register_budget_and_rule_routes(api, role_of, write, db_url)

    @api.get("/audit")
    async def audit(request: Request, limit: int = 100):
        role_of(request, "viewer")
        rows = await asyncio.to_thread(_in_session, db_url, lambda s: [
            {"at": a.at.isoformat(), "actor": a.actor, "action": a.action, "target": a.target, "before": a.before,
             "after": a.after} for a in queries.list_audit(s, limit)])
        return {"entries": rows}

    return api


def _in_session(db_url: str, fn, *args):
    with session_scope(db_url) as s:
        return fn(s, *args)


def _reload(db_url: str):
    from router_service.registry_cache import load_snapshot
    return load_snapshot(db_url)
