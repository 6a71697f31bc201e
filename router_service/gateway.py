"""Gateway checks per caller: request rate limit and daily token quota (docs/architecture.md, One request, step 3).

API keys are looked up by their hash in the registry snapshot (`RegistryCache.caller_for_key`); the
tier and adapter rights are checked in `Router.resolve_model`. This module holds the counters.

Quota accounting is in memory, per UTC day, for one router: at admission a request reserves
prompt + max_tokens tokens; when it ends the reservation is replaced by what it really used
(prompt + completion). A router restart may warm-start today's usage from the usage store
(`warm_start`). Several routers would need a shared counter (e.g. Redis INCRBY per caller-day or a
per-router share of each quota); see docs/router.md.
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass

from router_service.errors import RouterError

log = logging.getLogger(__name__)
DEFAULT_RATE_PER_S = 200.0  # requests per second per caller (token bucket refill)
DEFAULT_BURST = 400.0


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _ms_to_midnight() -> int:
    now = dt.datetime.now(dt.timezone.utc)
    midnight = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
    return int((midnight - now).total_seconds() * 1000)


@dataclass
class _Bucket:
    tokens: float
    updated: float


class Gateway:
    def __init__(self, rate_per_s: float = DEFAULT_RATE_PER_S, burst: float = DEFAULT_BURST) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.day = _today()
        self.used: dict[str, int] = {}       # caller -> tokens used today (finished requests)
        self.reserved: dict[str, int] = {}   # caller -> tokens reserved by requests in flight
        self.buckets: dict[str, _Bucket] = {}

    def check_rate(self, caller: str) -> None:
        """Token bucket per caller: `rate_per_s` requests per second, bursts up to `burst`."""
        now = time.monotonic()
        b = self.buckets.get(caller)
        if b is None:
            b = self.buckets[caller] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate_per_s)
        b.updated = now
        if b.tokens < 1:
            wait_ms = int((1 - b.tokens) / self.rate_per_s * 1000) + 1
            raise RouterError("resource_exhausted", f"rate limit: caller {caller!r} may send {self.rate_per_s:g} "
                                                    f"requests/s (burst {self.burst:g})", wait_ms)
        b.tokens -= 1

    def _roll_day(self) -> None:
        today = _today()
        if today != self.day:
            log.info("quota day rolled over from %s to %s", self.day, today)
            self.day, self.used = today, {}

    def reserve(self, caller: str, quota: int, tokens: int) -> None:
        """Reserve `tokens` of today's quota or raise RESOURCE_EXHAUSTED (retry after midnight UTC)."""
        self._roll_day()
        used = self.used.get(caller, 0) + self.reserved.get(caller, 0)
        if used + tokens > quota:
            raise RouterError("resource_exhausted",
                              f"token quota: caller {caller!r} has used {used} of {quota} tokens today (UTC); this "
                              f"request needs up to {tokens} (prompt + max_tokens)", _ms_to_midnight())
        self.reserved[caller] = self.reserved.get(caller, 0) + tokens

    def settle(self, caller: str, reserved: int, actual: int) -> None:
        """Replace a reservation by the tokens the request really used."""
        self._roll_day()
        self.reserved[caller] = max(0, self.reserved.get(caller, 0) - reserved)
        self.used[caller] = self.used.get(caller, 0) + actual

    def usage_today(self, caller: str) -> dict:
        self._roll_day()
        return {"day": self.day, "used": self.used.get(caller, 0), "reserved": self.reserved.get(caller, 0)}

    def warm_start(self, duckdb_path) -> None:
        """Best effort: load today's per-caller token totals from the usage store (skipped if locked/absent)."""
        try:
            import duckdb
            con = duckdb.connect(str(duckdb_path), read_only=True)
            try:
                rows = con.execute(
                    "SELECT caller, SUM(prompt_tokens + completion_tokens) FROM usage_events "
                    "WHERE day = CAST(? AS DATE) GROUP BY caller", [self.day]).fetchall()
            finally:
                con.close()
        except Exception as exc:  # a missing or busy store only means we start counting from zero
            log.info("quota warm start skipped: %s", exc)
            return
        for caller, total in rows:
            self.used[caller] = int(total or 0)
        log.info("quota warm start: today's usage for %d callers loaded", len(rows))
