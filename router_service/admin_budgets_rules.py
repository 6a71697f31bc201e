"""Admin endpoints for team budgets and automatic rollback rules (registered by admin_api.admin_router).

- GET  /admin/budgets                       viewer: every team's monthly budget
- PUT  /admin/budgets/{team}                operator: {monthly_amount} in the platform currency (audited)
- DELETE /admin/budgets/{team}              operator (audited)
- GET  /admin/rollback-rules                viewer
- PUT  /admin/rollback-rules/{model}/{version}  operator: {max_error_rate, max_ttft_ms_p95, minutes, armed}

Refusals are 400s carrying the registry's message; a write that changes nothing adds no audit row.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from common.settings import load_settings
from registry import budgets, rollback_rules
from registry.db import session_scope
from router_service.errors import RouterError


class BudgetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    monthly_amount: float = Field(ge=0, le=budgets.MAX_MONTHLY_AMOUNT, allow_inf_nan=False)


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
        rows = await read(lambda s: [{"team": b.team, "monthly_amount": b.monthly_amount, "currency": b.currency,
                                      "updated_at": b.updated_at.isoformat(), "updated_by": b.updated_by}
                                     for b in budgets.list_budgets(s)])
        return {"currency": currency, "budgets": rows}

    @api.put("/budgets/{team}")
    async def put_budget(team: str, body: BudgetBody, request: Request):
        actor = role_of(request, "operator")
        return await write(lambda s: budgets.set_budget(s, team, body.monthly_amount, currency, actor=actor))

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
