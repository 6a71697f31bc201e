"""A real OTLP/gRPC trace receiver for tests: a gRPC server implementing the collector's TraceService with
the OpenTelemetry protocol's own generated code (opentelemetry-proto), keeping every span it is sent."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from common.processes import free_port


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict
    error: bool = False


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "OtlpReceiver":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1)

    def Export(self, request, context):  # noqa: N802 (the protocol's method name)
        got = []
        for rs in request.resource_spans:
            service = next((str(_value(a.value)) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            s.name, s.start_time_unix_nano, s.end_time_unix_nano,
                                            {a.key: _value(a.value) for a in s.attributes},
                                            s.status.code == s.status.STATUS_CODE_ERROR))
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 20) -> list[ReceivedSpan]:
        """The trace's spans once every name in `names` has arrived (export is batched, every ~0.5 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.2)
        return self.trace(trace_id)


def check_resumed_trace(receiver: OtlpReceiver, request_id: str, failed_replica: str) -> None:
    """The trace of a request resumed after `failed_replica` hung: two upstream attempts under the request's
    span, the first on the hung replica and failed, the second elsewhere from the tokens already streamed,
    and the second replica's engine span under the second attempt."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with receiver._lock:
            root = next((s for s in receiver.spans if s.attributes.get("fleet.request_id") == request_id
                         and s.service == "fleet-router"), None)
        if root is not None:
            spans = receiver.trace(root.trace_id)
            attempts = sorted((s for s in spans if s.name == "router.upstream"), key=lambda s: s.attributes["fleet.attempt"])
            engines = [s for s in spans if s.name == "engine.request"]
            if len(attempts) == 2 and any(e.parent_span_id == attempts[1].span_id for e in engines):
                break
        time.sleep(0.2)
    else:
        with receiver._lock:
            seen = [(s.service, s.name, s.attributes.get("fleet.request_id"), s.attributes.get("fleet.attempt"))
                    for s in receiver.spans[-40:]]
        raise AssertionError(f"no trace with two attempts for {request_id}; last spans: {seen}")
    first, second = attempts
    assert first.parent_span_id == second.parent_span_id == root.span_id
    assert first.attributes["fleet.replica"] == failed_replica and first.error
    assert second.attributes["fleet.replica"] != failed_replica and not second.error
    assert second.attributes["fleet.resumed_tokens"] >= 8 and second.start_ns >= first.end_ns - 1_000_000
    engine = next(e for e in engines if e.parent_span_id == second.span_id)
    assert engine.attributes["fleet.replica"] == second.attributes["fleet.replica"]
