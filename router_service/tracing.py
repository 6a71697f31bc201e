"""The router's traces and access log: one server span per request (HTTP via `TracingMiddleware`, KServe
gRPC via `grpc_request`), child spans for the admission queue and for each upstream attempt (a resume is a
second attempt span), and the W3C context of each attempt sent to the replica as request parameters.

A caller's `traceparent` (HTTP header, gRPC metadata) becomes the parent of the router's span, so the
caller's trace id is kept end to end. Each request's access line (logger `fleet.access`: status, TTFT,
tokens, duration) is written when its span ends, so refused requests get one too. The request's ids travel
in the task's log context (common.logs.bind_request). Settings: common.tracing; fields: docs/observability.md.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from common.logs import bind_request
from common.names import CLIENT_ID_RE
from common.tracing import extract, inject

tracer = trace.get_tracer("llm-fleet.router")
access_log = logging.getLogger("fleet.access")
TRACED_PATH_PREFIX = "/v1/"
# FastAPI's own OpenTelemetry spans and metrics are off: the router's spans are these (TracingMiddleware), the
# same for HTTP and gRPC, and /metrics scrapes or state reports are never traced
FASTAPI_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                     "auto_configure": False}


def _start(frontend: str, client_request_id: str) -> dict:
    """Open the request's log context (the task's; common.logs): the caller's own id only when well formed
    (the HTTP frontend refuses a malformed one with a 400 naming the header), and the access line's clock."""
    ctx = bind_request(client_request_id=client_request_id if CLIENT_ID_RE.match(client_request_id or "") else "")
    ctx["_started"] = repr(time.monotonic())
    ctx["_frontend"] = frontend
    return ctx


def _access(ctx: dict, status: str, span: trace.Span) -> None:
    """One line per request, when it ends (refused ones included)."""
    duration_ms = (time.monotonic() - float(ctx.get("_started", time.monotonic()))) * 1000
    fields: dict[str, Any] = {"status": ctx.get("outcome", status), "frontend": ctx.get("_frontend", ""),
                              "duration_ms": round(duration_ms, 3)}
    for name, kind in (("ttft_ms", float), ("prompt_tokens", int), ("completion_tokens", int)):
        if name in ctx:
            fields[name] = kind(ctx[name])
    if "finish_reason" in ctx:
        fields["finish_reason"] = ctx["finish_reason"]
    if "error_code" in ctx:
        fields["error_code"] = ctx["error_code"]
    span.set_attributes({f"fleet.{k}": v for k, v in fields.items()})
    access_log.info("%s %s %s ttft_ms=%s tokens=%s duration_ms=%.1f", fields["frontend"], ctx.get("model", "-"),
                    fields["status"], fields.get("ttft_ms", "-"), fields.get("completion_tokens", "-"),
                    duration_ms, extra=fields)


class TracingMiddleware:
    """Pure ASGI middleware around the callers' `/v1/` endpoints: the span lasts until the last byte of a
    streamed answer is sent. It also keeps a caller's `x-request-id` as the correlation id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PATH_PREFIX):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        ctx = _start("http", headers.get("x-request-id", ""))
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        with tracer.start_as_current_span(f"{scope['method']} {scope['path']}", context=extract(headers),
                                          kind=SpanKind.SERVER,
                                          attributes={"http.request.method": scope["method"],
                                                      "url.path": scope["path"]}) as span:
            try:
                await self.app(scope, receive, send_status)
            finally:
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                _access(ctx, "ok" if status[0] < 400 else str(status[0]), span)


@contextmanager
def grpc_request(method: str, metadata: Any, client_request_id: str = "") -> Iterator[trace.Span]:
    """The server span of one KServe request (one per request on a ModelStreamInfer stream)."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    ctx = _start("grpc", client_request_id)
    with tracer.start_as_current_span(f"KServe/{method}", context=extract(carrier), kind=SpanKind.SERVER,
                                      attributes={"rpc.system": "grpc", "rpc.method": method}) as span:
        try:
            yield span
        finally:
            _access(ctx, "error" if "error_code" in ctx else "ok", span)


def annotate(p: Any) -> None:
    """Once a request is prepared: its ids on the log context and the span (p: request.Prepared)."""
    req = p.req
    bind_request(request_id=req.request_id, caller=p.caller.name, model=p.model.name, version=p.model.version,
                 tier=req.tier, client_request_id=req.client_id)
    trace.get_current_span().set_attributes({
        "fleet.request_id": req.request_id, "fleet.caller": p.caller.name, "fleet.model": p.model.name,
        "fleet.version": p.model.version, "fleet.tier": req.tier, "fleet.prompt_tokens": len(p.prompt_ids)})


def refused(code: str) -> None:
    """A request refused before streaming (the RouterError's code)."""
    bind_request(error_code=code, outcome=code)
    trace.get_current_span().set_status(Status(StatusCode.ERROR, code))


def finished(status: str, reason: str, prompt_tokens: int, completion_tokens: int, ttft_s: float | None) -> None:
    """What the access line reports about a streamed request (called where it is accounted)."""
    fields: dict[str, Any] = {"outcome": status, "finish_reason": reason, "prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens}
    if ttft_s is not None:
        fields["ttft_ms"] = round(ttft_s * 1000, 3)
    bind_request(**fields)


@contextmanager
def admission_span(tier: str) -> Iterator[trace.Span]:
    """Waiting for a replica slot (the admission queue) and the replica choice."""
    with tracer.start_as_current_span("router.admission", attributes={"fleet.tier": tier}) as span:
        yield span


def placed(span: trace.Span, placement: Any) -> None:
    span.set_attributes({"fleet.replica": placement.replica.replica_id, "fleet.policy": placement.policy})


def start_attempt(replica_id: str, attempt: int, resumed_tokens: int) -> tuple[trace.Span, dict[str, str]]:
    """A span for one upstream call, child of the request's span but not made current: the stream
    generator that owns it may be closed from another context. Returns it and its W3C fields for the replica."""
    span = tracer.start_span("router.upstream", kind=SpanKind.CLIENT, attributes={
        "fleet.replica": replica_id, "fleet.attempt": attempt, "fleet.resumed_tokens": resumed_tokens})
    return span, inject(span)


def end_attempt(span: trace.Span, tokens: int, error: BaseException | None) -> None:
    span.set_attribute("fleet.tokens", tokens)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.record_exception(error)
    span.end()
