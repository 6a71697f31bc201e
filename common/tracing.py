"""OpenTelemetry setup shared by the router and the replicas: one tracer provider per process, exporting
over OTLP/gRPC to Settings.otlp_endpoint (FLEET_OTLP_ENDPOINT) with a parent-based ratio sampler
(FLEET_TRACE_SAMPLE_RATIO). Without an endpoint no SDK is installed: spans are the API's no-op spans, which
still carry a caller's trace context, so a `traceparent` passes through the platform untouched.

W3C trace context (`traceparent`, `tracestate`) is the one propagation format: HTTP headers, gRPC metadata
and, router -> replica, request parameters of the same names (docs/observability.md "Traces").
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)
PROPAGATOR = TraceContextTextMapPropagator()
TRACE_KEYS = ("traceparent", "tracestate")
MAX_TRACE_HEADER_CHARS = 512  # W3C allows 55 for traceparent and 512 for tracestate: longer is dropped
_provider = None


def configure(service: str, endpoint: str, ratio: float = 1.0, **resource: str):
    """Install the SDK provider once per process when `endpoint` is set; returns it (None: tracing off)."""
    global _provider
    if not endpoint or _provider is not None:
        return _provider
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    insecure = not endpoint.startswith("https://")
    provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}),
                              sampler=ParentBased(TraceIdRatioBased(ratio)))
    # Batched export on the processor's own thread: a request never waits for the collector
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
                                                   schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing: OTLP export to %s, sample ratio %g", endpoint, ratio)
    return provider


def shutdown() -> None:
    """Flush the spans still queued (at a clean stop)."""
    if _provider is not None:
        _provider.shutdown()


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The trace context a caller sent (W3C headers / metadata / request parameters); an empty context
    when none or malformed (the request then starts a trace of its own)."""
    if not carrier:
        return Context()
    fields = {k: v for k, v in carrier.items() if k in TRACE_KEYS and isinstance(v, str)
              and len(v) <= MAX_TRACE_HEADER_CHARS}
    return PROPAGATOR.extract(fields) if fields else Context()


def inject(span: trace.Span) -> dict[str, str]:
    """W3C fields naming `span` as the parent (empty when the span carries no valid context)."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier
