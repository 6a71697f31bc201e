"""What a finished request leaves behind: Prometheus counters and one usage event (docs/architecture.md,
Usage events); while it streams, an in-flight ledger entry that bills its tokens if the router dies first."""
from __future__ import annotations

import logging
import time

from common.logs import current_trace_ids
from router_service import metrics, tracing
from router_service.request import Finished, Prepared
from usage.events import UsageEvent

log = logging.getLogger(__name__)


class UsageLedgerEntry:
    """A stream's slot in the producer's in-flight ledger: its token count follows the stream, so the
    tokens are billed even if this router dies before the stream ends (see usage.inflight)."""

    def __init__(self, ledger, slot: int) -> None:
        self.ledger, self.slot = ledger, slot

    def progress(self, completion_tokens: int) -> None:
        self.ledger.progress(self.slot, completion_tokens)

    def close(self) -> None:
        self.ledger.close(self.slot)


def open_ledger_entry(producer, p: Prepared) -> UsageLedgerEntry | None:
    ledger = getattr(producer, "ledger", None)
    if ledger is None:
        return None
    try:
        slot = ledger.open(_event(p, None, "error", "error", 0, None, ""))
    except Exception:
        log.exception("could not open an in-flight usage entry for %s", p.req.request_id)
        return None
    if slot is None:
        metrics.USAGE_LEDGER_FULL.inc()
        return None
    return UsageLedgerEntry(ledger, slot)


def _event(p: Prepared, finish: Finished | None, status: str, reason: str, completion_tokens: int,
           first_token_at: float | None, replica_id: str) -> UsageEvent:
    req, now = p.req, time.monotonic()
    return UsageEvent(
        request_id=req.request_id, ts=time.time(), caller=p.caller.name, team=p.caller.team,
        model=p.model.name, version=p.model.version, adapter=req.adapter, priority=req.tier,
        region=p.home, replica_id=replica_id, prompt_tokens=len(p.prompt_ids) if req.bill_prompt else 0,
        cached_prompt_tokens=finish.cached_prompt_tokens if finish and req.bill_prompt else 0,
        completion_tokens=completion_tokens,
        ttft_ms=round((first_token_at - p.arrived) * 1000, 3) if first_token_at else 0.0,
        duration_ms=round((now - p.arrived) * 1000, 3), finish_reason=reason, status=status,
        trace_id=current_trace_ids()[0] or None)  # the request's span (the caller's trace id when given)


def account(producer, p: Prepared, finish: Finished | None, status: str, completion_tokens: int,
            first_token_at: float | None, replica_id: str, entry: UsageLedgerEntry | None = None) -> None:
    """Count the request in the metrics and spool its usage event, then free its ledger entry (never
    raises: metering must not break serving)."""
    req = p.req
    reason = finish.finish_reason if finish else ("cancelled" if status == "cancelled" else "error")
    if status == "ok" and reason == "cancelled":
        status = "cancelled"
    now = time.monotonic()
    tracing.finished(status, reason, len(p.prompt_ids), completion_tokens,
                     first_token_at - p.arrived if first_token_at is not None else None)
    metrics.REQUESTS.labels(req.model, req.tier, status).inc()
    metrics.TOKENS.labels(req.model, req.tier).inc(completion_tokens)
    if req.bill_prompt:  # choices 2..n of an `n` request share choice 1's prompt: counted once, as billed
        metrics.PROMPT_TOKENS.labels(req.model, req.tier).inc(len(p.prompt_ids))
        if finish is not None:
            metrics.CACHED_PROMPT_TOKENS.labels(req.model, req.tier).inc(finish.cached_prompt_tokens)
    labels = (req.model, p.model.version, req.tier)
    metrics.REQUEST_DURATION.labels(*labels, status).observe(now - p.arrived)
    metrics.PROMPT_LENGTH.labels(*labels).observe(len(p.prompt_ids))
    metrics.COMPLETION_LENGTH.labels(*labels).observe(completion_tokens)
    metrics.FINISHED.labels(*labels, reason).inc()
    if first_token_at is not None and completion_tokens > 1 and now > first_token_at:
        metrics.STREAM_TOKENS_PER_S.labels(req.model, req.tier).observe((completion_tokens - 1) / (now - first_token_at))
    if producer is None:
        return
    try:
        producer.emit(_event(p, finish, status, reason, completion_tokens, first_token_at, replica_id))
    except Exception as exc:
        # Not swallowed: counted and logged with what the bill needs. The ledger entry is kept, so the
        # next start of a producer on this spool still spools these tokens.
        metrics.USAGE_EMIT_ERRORS.labels(type(exc).__name__).inc()
        log.error("could not spool usage event for %s (caller %s, %d prompt + %d completion tokens): %s",
                  req.request_id, p.caller.name, len(p.prompt_ids), completion_tokens, exc)
        return
    if entry is not None:
        entry.close()
