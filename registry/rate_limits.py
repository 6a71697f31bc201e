"""Per-caller request rate (requests/s) and token rate (tokens/min) shared by every router.

Each caller has one `caller_rates` row of sliding-window counters: the current and the previous fixed window
(1 s for requests, 1 min for tokens). The rate over the last window length is estimated as
`previous x (share of the previous window still inside the last window length) + current`, the usual sliding
window approximation: a burst never passes the limit within one window, and a steady rate sees at most the limit.
Tokens are counted at admission as the request's worst case (prompt + max_tokens) and corrected to what it used
when it settles (`give_back`), so the limit meters real tokens once requests end.

The row is read and written only inside quotas.admit_many / settle_many after the caller's quota_usage row is
locked, so admissions of one caller are serialised across routers and the check cannot be raced.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy.orm import Session

from registry.schema import CallerRate

MINUTE_S = 60


@dataclass(frozen=True)
class RateRefused:
    message: str
    retry_ms: int


def _slide(start: int, cur: float, prev: float, window: int) -> tuple[int, float, float]:
    """Move the counters to `window` (an index of fixed windows): (start, current, previous)."""
    if window == start:
        return start, cur, prev
    if window == start + 1:
        return window, 0, cur
    return window, 0, 0


def _estimate(now: float, length: float, cur: float, prev: float) -> float:
    elapsed = now / length - math.floor(now / length)
    return prev * (1.0 - elapsed) + cur


def row_for(session: Session, caller: str) -> CallerRate:
    row = session.get(CallerRate, caller)
    if row is None:
        row = CallerRate(caller=caller, sec_start=0, sec_count=0, sec_prev=0, min_start=0, min_tokens=0, min_prev=0)
        session.add(row)
    return row


def take(row: CallerRate, now: float, requests_per_s: float, tokens_per_minute: int,
         tokens: int) -> RateRefused | None:
    """Count one request of `tokens` (worst case) against the caller's limits (0 = none), or say why not.
    A refusal changes nothing."""
    sec = _slide(int(row.sec_start), row.sec_count, row.sec_prev, int(now))
    minute = _slide(int(row.min_start), row.min_tokens, row.min_prev, int(now // MINUTE_S))
    if requests_per_s > 0 and _estimate(now, 1.0, sec[1], sec[2]) + 1 > requests_per_s:
        return RateRefused(f"rate limit: caller {row.caller!r} may send {requests_per_s:g} requests/s across every "
                           f"router", max(1, int((1.0 - (now - int(now))) * 1000)))
    if tokens_per_minute > 0:
        if tokens > tokens_per_minute:
            return RateRefused(f"token rate limit: this request needs up to {tokens} tokens (prompt + max_tokens); "
                               f"caller {row.caller!r} may use {tokens_per_minute} tokens/min: lower max_tokens",
                               MINUTE_S * 1000)
        used = _estimate(now, MINUTE_S, minute[1], minute[2])
        if used + tokens > tokens_per_minute:
            return RateRefused(f"token rate limit: caller {row.caller!r} has used ~{int(used)} of {tokens_per_minute} "
                               f"tokens/min across every router; this request needs up to {tokens}",
                               max(1, int((MINUTE_S - now % MINUTE_S) * 1000)))
    row.sec_start, row.sec_count, row.sec_prev = sec[0], int(sec[1]) + 1, int(sec[2])
    row.min_start, row.min_tokens, row.min_prev = minute[0], int(minute[1]) + tokens, int(minute[2])
    return None


def give_back(row: CallerRate, minute: int, tokens: int) -> None:
    """A request counted `tokens` more than it used in unix minute `minute`: take them off that window
    (if it is still one of the two the row keeps)."""
    if tokens <= 0:
        return
    if int(row.min_start) == minute:
        row.min_tokens = max(0, int(row.min_tokens) - tokens)
    elif int(row.min_start) == minute + 1:
        row.min_prev = max(0, int(row.min_prev) - tokens)
