"""The replica's spans of one request, parented by the router's upstream-attempt span (W3C `traceparent`
sent as a request parameter): `engine.request` (arrival -> last response) with children `engine.queue`
(arrival -> admitted), `engine.prefill` (admitted -> first token) and `engine.decode` (first token -> end),
with token counts as attributes.

Nothing runs on the engine loop thread: the spans are built once, from the sequence's own timestamps, when
its final output is handed to Triton (on the courier thread), and exported by the SDK's batch processor.
Without an OTLP endpoint (common.tracing) or a sampled parent nothing is recorded.
"""
from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.tracing import extract

tracer = trace.get_tracer("llm-fleet.engine")


def _clock() -> tuple[float, int]:
    """(now on time.monotonic(), its offset to epoch ns): spans carry wall-clock times; one offset per
    request keeps its spans nested exactly."""
    return time.monotonic(), time.time_ns() - time.monotonic_ns()


def record_request(carrier: dict[str, Any], seq: Any, finish_reason: str, replica_id: str) -> None:
    """The spans of one finished sequence (`seq`: engine.sequence.Sequence)."""
    parent = extract(carrier)
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return  # the router sent no trace context: the replica starts no traces of its own
    end, offset = _clock()

    def _epoch_ns(monotonic_s: float) -> int:
        return offset + int(monotonic_s * 1e9)

    admitted = seq.admitted_at or end
    first = seq.first_token_at or end
    root = tracer.start_span("engine.request", context=parent, kind=SpanKind.SERVER, start_time=_epoch_ns(seq.arrival),
                             attributes={"fleet.replica": replica_id, "fleet.request_id": str(seq.request_id or ""),
                                         "fleet.prompt_tokens": seq.num_prompt,
                                         "fleet.cached_prompt_tokens": seq.num_cached_prompt,
                                         "fleet.completion_tokens": seq.num_emitted,
                                         "fleet.preemptions": seq.preemptions, "fleet.finish_reason": finish_reason,
                                         "fleet.priority": seq.priority})
    if finish_reason == "error":
        root.set_status(Status(StatusCode.ERROR, seq.error or "error"))
    ctx = trace.set_span_in_context(root)
    for name, start, stop, attrs in (
            ("engine.queue", seq.arrival, admitted, {}),
            ("engine.prefill", admitted, first, {"fleet.prompt_tokens": seq.num_prompt - seq.num_cached_prompt}),
            ("engine.decode", first, end, {"fleet.completion_tokens": max(0, seq.num_emitted - 1)})):
        if seq.admitted_at is None and name != "engine.queue":
            continue  # never admitted (cancelled or refused while waiting)
        tracer.start_span(name, context=ctx, start_time=_epoch_ns(start), attributes=attrs).end(_epoch_ns(stop))
    root.end(_epoch_ns(end))
