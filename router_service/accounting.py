"""What a finished request leaves behind: Prometheus counters and one usage event
(docs/architecture.md, Usage events)."""
from __future__ import annotations

import logging
import time

from router_service import metrics
from router_service.request import Finished, Prepared
from usage.events import UsageEvent

log = logging.getLogger(__name__)


def account(producer, p: Prepared, finish: Finished | None, status: str, completion_tokens: int,
            first_token_at: float | None, replica_id: str) -> None:
    """Count the request in the metrics and spool its usage event (never raises: metering must not break serving)."""
    req = p.req
    reason = finish.finish_reason if finish else ("cancelled" if status == "cancelled" else "error")
    if status == "ok" and reason == "cancelled":
        status = "cancelled"
    now = time.monotonic()
    metrics.REQUESTS.labels(req.model, req.tier, status).inc()
    metrics.TOKENS.labels(req.model, req.tier).inc(completion_tokens)
    metrics.PROMPT_TOKENS.labels(req.model, req.tier).inc(len(p.prompt_ids))
    if finish is not None:
        metrics.CACHED_PROMPT_TOKENS.labels(req.model, req.tier).inc(finish.cached_prompt_tokens)
    if first_token_at is not None and completion_tokens > 1 and now > first_token_at:
        metrics.STREAM_TOKENS_PER_S.labels(req.model, req.tier).observe((completion_tokens - 1) / (now - first_token_at))
    if producer is None:
        return
    event = UsageEvent(
        request_id=req.request_id, ts=time.time(), caller=p.caller.name, team=p.caller.team,
        model=p.model.name, version=p.model.version, adapter=req.adapter, priority=req.tier,
        region=p.home, replica_id=replica_id, prompt_tokens=len(p.prompt_ids),
        cached_prompt_tokens=finish.cached_prompt_tokens if finish else 0, completion_tokens=completion_tokens,
        ttft_ms=round((first_token_at - p.arrived) * 1000, 3) if first_token_at else 0.0,
        duration_ms=round((now - p.arrived) * 1000, 3), finish_reason=reason, status=status)
    try:
        producer.emit(event)
    except Exception:
        log.exception("could not spool usage event for %s", req.request_id)
