"""Admin endpoints for team budgets and automatic rollback rules (registered by admin_api.admin_router).

- GET  /admin/budgets                       viewer: every team's budget (`budgets`) and every key's own budget
                                            (`key_budgets`) with the routers' spend and reservations in its
                                            current period
- PUT  /admin/budgets/{team}                operator: {monthly_amount, period, unit, soft_share, enforce}: the
                                            amount per period (month|day) in the platform currency or tokens
                                            (audited)
- DELETE /admin/budgets/{team}              operator (audited)
- PUT  /admin/callers/{name}/budget         operator: the same body, one API key's own budget, enforced besides its
                                            team's (audited: set_key_budget)
- DELETE /admin/callers/{name}/budget       operator (audited: delete_key_budget)
- PUT  /admin/callers/{name}/limits         operator: {requests_per_s, tokens_per_minute}, shared by every
                                            router, 0 = none (audited)
- PUT  /admin/teams/{team}/weight           operator: {weight}, the team's fair share in a busy tier (audited)
- GET  /admin/rollback-rules                viewer
- PUT  /admin/rollback-rules/{model}/{version}  operator: {max_error_rate, max_ttft_ms_p95, minutes, armed}

Refusals are 400s carrying the registry's message; a write that changes nothing adds no audit row.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from common.settings import load_settings
from registry import budgets, caller_limits, rollback_rules
from registry.db import session_scope
from router_service.errors import RouterError


class BudgetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    monthly_amount: float = Field(ge=0, le=budgets.MAX_MONTHLY_AMOUNT, allow_inf_nan=False)  # per `period`
    period: Literal["month", "day"] = "month"
    unit: Literal["money", "tokens"] = "money"
    soft_share: float = Field(default=0.8, gt=0, le=1)
    enforce: bool = True


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests_per_s: float = Field(default=0.0, ge=0, le=caller_limits.MAX_REQUESTS_PER_S, allow_inf_nan=False)
    tokens_per_minute: int = Field(default=0, ge=0, le=caller_limits.MAX_TOKENS_PER_MINUTE)


class WeightBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float = Field(ge=caller_limits.WEIGHT_RANGE[0], le=caller_limits.WEIGHT_RANGE[1], allow_inf_nan=False)


class RuleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_error_rate: float | None = Field(default=None, ge=0, lt=1)
    max_ttft_ms_p95: float | None = Field(default=None, ge=rollback_rules.TTFT_RANGE_MS[0],
                                          le=rollback_rules.TTFT_RANGE_MS[1])
    minutes: int = Field(default=5, ge=rollback_rules.MINUTES_RANGE[0], le=rollback_rules.MINUTES_RANGE[1])
    armed: bool = True


def register_budget_and_rule_routes(api: APIRouter, role_of: Callable[[Request, str], str],
                                    write: Callable[..., Awaitable], db_url: str) -> None:
    currency = load_settings().currency

    def read(fn):
        def run():
            with session_scope(db_url) as s:
                return fn(s)
        return asyncio.to_thread(run)

    @api.get("/budgets")
    async def list_budgets(request: Request):
        role_of(request, "viewer")
        def rows(s, scope: budgets.Scope):
            spend = budgets.spend_rows(s, scope=scope)
            owner = scope.owner_attr
            return [{owner: getattr(b, owner), **budgets.budget_dict(b), "updated_at": b.updated_at.isoformat(),
                     "updated_by": b.updated_by, **spend.get(getattr(b, owner), {})}
                    for b in budgets.list_budgets(s, scope)]
        return {"currency": currency, "budgets": await read(lambda s: rows(s, budgets.TEAM)),
                "key_budgets": await read(lambda s: rows(s, budgets.KEY))}

    @api.put("/budgets/{team}")
    async def put_budget(team: str, body: BudgetBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: budgets.set_budget(s, team, body.monthly_amount, currency, actor=actor,
                                                        period=body.period, unit=body.unit,
                                                        soft_share=body.soft_share, enforce=body.enforce))

    @api.put("/callers/{name}/budget")
    async def put_key_budget(name: str, body: BudgetBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: budgets.set_budget(s, name, body.monthly_amount, currency, actor=actor,
                                                        period=body.period, unit=body.unit, soft_share=body.soft_share,
                                                        enforce=body.enforce, scope=budgets.KEY))

    @api.delete("/callers/{name}/budget")
    async def delete_key_budget(name: str, request: Request):
        actor = role_of(request, "operator")
        if not await write(lambda s: budgets.delete_budget(s, name, actor=actor, scope=budgets.KEY)):
            raise RouterError("not_found", f"caller {name!r} has no budget of its own")
        return {"caller": name, "deleted": True}

    @api.put("/callers/{name}/limits")
    async def put_limits(name: str, body: LimitsBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: caller_limits.set_caller_limits(s, name, actor=actor, **body.model_dump()))

    @api.put("/teams/{team}/weight")
    async def put_weight(team: str, body: WeightBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: caller_limits.set_team_weight(s, team, body.weight, actor=actor))

    @api.delete("/budgets/{team}")
    async def delete_budget(team: str, request: Request):
        actor = role_of(request, "operator")
        if not await write(lambda s: budgets.delete_budget(s, team, actor=actor)):
            raise RouterError("not_found", f"team {team!r} has no budget")
        return {"team": team, "deleted": True}

    @api.get("/rollback-rules")
    async def list_rules(request: Request):
        role_of(request, "viewer")
        return {"rules": await read(lambda s: [rollback_rules.rule_dict(r) for r in rollback_rules.list_rules(s)])}

    @api.put("/rollback-rules/{model}/{version}")
    async def put_rule(model: str, version: str, body: RuleBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: rollback_rules.set_rule(s, model, version, actor=actor, **body.model_dump()))
