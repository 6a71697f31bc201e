"""Budgets at admission (a team's, and optionally its API key's own): what a request may cost (its worst case,
prompt + max_tokens) and what it did cost, in each budget's unit, priced with the same per-model rates
chargeback uses (usage/store.py `prices`: uncached prompt at the prefill rate, cached prompt at the cached
rate, completion at the decode rate).

The shared check and reservation are registry/quotas.py's (one transaction with the caller's quota lease);
this module only turns a request into a `BudgetAsk` and a finished request into its cost. Prices are re-read
from the usage store every `refresh_s` (off the event loop); until the first read, and whenever the store
cannot be read, the last prices (at first the store's defaults) hold.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from registry.budgets import period_key
from registry.quotas import BudgetAsk
from router_service.registry_cache import BudgetInfo
from usage import store

if TYPE_CHECKING:
    from router_service.request import Prepared

log = logging.getLogger(__name__)
PER_M = 1_000_000


class PriceBook:
    def __init__(self, store_path: Path | None = None, refresh_s: float = 60.0) -> None:
        self.store_path, self.refresh_s = store_path, refresh_s
        self.prices: dict[str, tuple[float, float, float]] = {m: (p, c, d) for m, p, c, d in store.DEFAULT_PRICES}

    def rates(self, model: str) -> tuple[float, float, float]:
        """(prefill, cached, decode) per 1M tokens of `model` (the '*' fallback when not priced)."""
        return self.prices.get(model) or self.prices.get("*") or (0.0, 0.0, 0.0)

    def cost(self, model: str, prompt: int, cached: int, completion: int) -> float:
        prefill, cached_rate, decode = self.rates(model)
        return ((prompt - cached) * prefill + cached * cached_rate + completion * decode) / PER_M

    def reload(self) -> None:
        if self.store_path is None:
            return
        frame = store.list_prices(self.store_path)
        self.prices = {r.model: (float(r.prefill_per_m), float(r.cached_per_m), float(r.decode_per_m))
                       for r in frame.itertuples()}

    async def refresh_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.reload)
            except Exception as exc:  # the last prices hold; chargeback reprices from the events anyway
                log.warning("could not read prices from %s: %s", self.store_path, exc)
            await asyncio.sleep(self.refresh_s)


def ask(budget: BudgetInfo | None, prices: PriceBook, model: str, prompt: int, max_tokens: int,
        now: float | None = None) -> BudgetAsk | None:
    """The request's claim on its team's budget: worst case = every prompt token uncached + max_tokens."""
    if budget is None:
        return None
    return BudgetAsk(period_key(budget.period, time.time() if now is None else now), budget.period, budget.amount,
                     budget.unit, budget.soft_share, budget.enforce,
                     settled_cost(budget, prices, model, prompt, 0, max_tokens))


def settled_cost(budget: BudgetInfo | None, prices: PriceBook, model: str, prompt: int, cached: int,
                 completion: int) -> float:
    """What a request used, in its team budget's unit (0 without a budget)."""
    if budget is None:
        return 0.0
    if budget.unit == "tokens":
        return float(prompt + completion)
    return prices.cost(model, prompt, cached, completion)


WARNING_HEADER = "x-fleet-budget-warning"


def warning_headers(p: Prepared) -> dict[str, str]:
    """The soft-limit warning as a response header (streams: SSE responses cannot add body fields up front)."""
    return {WARNING_HEADER: p.budget_warning} if p.budget_warning else {}


def warning_fields(p: Prepared) -> dict[str, str]:
    """The soft-limit warning as a field of a whole (non-streamed) response."""
    return {"budget_warning": p.budget_warning} if p.budget_warning else {}
