"""Logging setup shared by every service, and the request context every log line about a request carries.

Two formats (Settings.log_format, FLEET_LOG_FORMAT): `text`, one human line per event for a terminal, and
`json`, one JSON object per line (python-json-logger) for log shippers. Either way a line logged while a
request is being served carries that request's ids: `bind_request` fills a per-task context (each request
runs in its own asyncio task, so nothing leaks between requests) and `RequestContextFilter` copies it, plus
the current OpenTelemetry trace and span ids, onto every record. Field names: docs/observability.md "Logs".
"""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

# The fields a request's log lines carry (empty until known: a refused request may have no model yet)
REQUEST_FIELDS = ("request_id", "client_request_id", "caller", "model", "version", "tier")
_request: ContextVar[dict[str, str] | None] = ContextVar("fleet_request", default=None)


def bind_request(**fields: Any) -> dict[str, str]:
    """Start (or add to) the current task's request context; returns the dict, which later calls may fill."""
    ctx = _request.get()
    if ctx is None:
        ctx = {}
        _request.set(ctx)
    ctx.update({k: str(v) for k, v in fields.items() if v is not None and v != ""})
    return ctx


def request_context() -> dict[str, str]:
    return dict(_request.get() or {})


def current_trace_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span as 32/16 hex digits, or ("", "") outside a trace."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class RequestContextFilter(logging.Filter):
    """Puts the request context and trace ids on every record (as attributes: JSON fields, text suffix)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _request.get() or {}
        for name in REQUEST_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, ctx.get(name, ""))
        trace_id, span_id = current_trace_ids()
        record.trace_id, record.span_id = getattr(record, "trace_id", "") or trace_id, span_id
        record.request_suffix = (f" [request_id={record.request_id} trace_id={record.trace_id}]"
                                 if record.request_id and record.trace_id else
                                 f" [request_id={record.request_id}]" if record.request_id else "")
        return True


class FleetJsonFormatter(JsonFormatter):
    """One JSON object per line: time, level, component, logger, message, the request fields (when set),
    trace ids, and any `extra=` fields (the access log's status, ttft_ms, tokens, duration_ms)."""

    def __init__(self, component: str) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                         static_fields={"component": component}, timestamp=False)

    def process_log_record(self, log_record: dict[str, Any]) -> dict[str, Any]:
        log_record.pop("request_suffix", None)
        # empty request fields are noise on lines about no request
        for name in (*REQUEST_FIELDS, "trace_id", "span_id"):
            if not log_record.get(name):
                log_record.pop(name, None)
        return log_record


def formatter(component: str, fmt: str) -> logging.Formatter:
    if fmt == "json":
        return FleetJsonFormatter(component)
    if fmt != "text":
        raise ValueError(f"log format {fmt!r}: allowed are text, json")
    return logging.Formatter(f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s%(request_suffix)s")


def setup_logging(component: str, level: str = "INFO", fmt: str = "text") -> logging.Logger:
    """Configure the root logger once, at start; `level` and `fmt` come from Settings.log_level / log_format
    (FLEET_LOG_LEVEL, FLEET_LOG_FORMAT)."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(component, fmt))
    handler.addFilter(RequestContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("alembic", "kafka", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(component)
