"""End to end on the session's platform: a caller's W3C trace context is honoured and propagated router ->
replica (spans checked as a real OTLP receiver decoded them), and the router's JSON log lines carry the
request's ids, with one access line per request."""
from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest

from tests.integration.platform import stream_completion
from tests.observability.otlp_receiver import ReceivedSpan

pytestmark = pytest.mark.integration
ROUTER_SPANS = {"router.admission", "router.upstream"}
REPLICA_SPANS = {"engine.request", "engine.queue", "engine.prefill", "engine.decode"}


def _caller_context() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"expected one {name} span, got {[(s.name, s.service) for s in spans]}"
    return found[0]


def _check_tree(spans: list[ReceivedSpan], root_name: str, caller_span: str) -> None:
    root = _one(spans, root_name)
    assert root.service == "fleet-router" and root.parent_span_id == caller_span, "router span not under the caller's"
    admission, upstream = _one(spans, "router.admission"), _one(spans, "router.upstream")
    assert admission.parent_span_id == root.span_id and upstream.parent_span_id == root.span_id
    engine = _one(spans, "engine.request")
    assert engine.service == "fleet-replica" and engine.parent_span_id == upstream.span_id
    assert engine.attributes["fleet.replica"] == upstream.attributes["fleet.replica"]
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        child = _one(spans, name)
        assert child.parent_span_id == engine.span_id
        assert engine.start_ns <= child.start_ns <= child.end_ns <= engine.end_ns
    assert engine.attributes["fleet.completion_tokens"] == 12
    assert _one(spans, "engine.decode").attributes["fleet.completion_tokens"] == 11


def _router_log(platform) -> list[dict]:
    lines = (platform.data_dir / "logs" / "router.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _access_lines(platform, key: str, value: str, timeout_s: float = 15.0) -> list[dict]:
    """The request's access lines. The router writes one when the request has ended, which may be just after the
    caller has its last byte, so this waits (bounded) for it to reach the log file."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r for r in _router_log(platform) if r.get("logger") == "fleet.access" and r.get(key) == value]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_http_stream_keeps_the_callers_trace_and_request_id(platform, otlp_receiver):
    trace_id, span_id, traceparent = _caller_context()
    client_id = f"caller-{secrets.token_hex(4)}"
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "priority": "interactive", "messages": [{"role": "user", "content": "Name a colour."}]}
    headers = {"authorization": f"Bearer {platform.api_key}", "traceparent": traceparent, "x-request-id": client_id}
    with httpx.stream("POST", f"{platform.http_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    assert resp.headers["x-request-id"] == client_id, "the caller's x-request-id is its correlation id"
    request_id = resp.headers["x-fleet-request-id"]
    assert request_id.startswith("req-") and json.loads(chunks[0][6:])["id"] == request_id

    spans = otlp_receiver.wait_for(trace_id, {"POST /v1/chat/completions", *ROUTER_SPANS, *REPLICA_SPANS})
    _check_tree(spans, "POST /v1/chat/completions", span_id)
    assert _one(spans, "engine.request").attributes["fleet.request_id"] == request_id

    access = _access_lines(platform, "request_id", request_id)
    assert len(access) == 1, f"one access line per request, got {access}"
    line = access[0]
    assert line["trace_id"] == trace_id and line["client_request_id"] == client_id
    assert (line["model"], line["tier"]) == ("smollm2-135m", "interactive")
    assert line["version"] and line["caller"] and line["status"] == "ok" and line["frontend"] == "http"
    assert line["completion_tokens"] == 12 and 0 < line["ttft_ms"] <= line["duration_ms"]


def test_grpc_stream_traceparent_metadata_and_refused_request_access_line(platform, otlp_receiver):
    trace_id, span_id, traceparent = _caller_context()
    stream_completion(platform.grpc_url, "Name a colour.", "smollm2-135m", 12,
                      {"authorization": f"Bearer {platform.api_key}", "traceparent": traceparent}, ignore_eos=True)
    spans = otlp_receiver.wait_for(trace_id, {"KServe/ModelStreamInfer", *ROUTER_SPANS, *REPLICA_SPANS})
    _check_tree(spans, "KServe/ModelStreamInfer", span_id)

    # a refused request (unknown model) has its access line too, with the error code and trace id
    trace_id, _, traceparent = _caller_context()
    resp = httpx.post(f"{platform.http_url}/v1/completions", timeout=30,
                      headers={"authorization": f"Bearer {platform.api_key}", "traceparent": traceparent},
                      json={"model": "no-such-model", "prompt": "hi", "max_tokens": 4})
    assert resp.status_code == 404
    refused = _access_lines(platform, "trace_id", trace_id)
    assert len(refused) == 1 and refused[0]["status"] == "not_found" and refused[0]["error_code"] == "not_found"

    # a malformed correlation id is refused, naming the header and what is allowed
    bad = httpx.post(f"{platform.http_url}/v1/completions", timeout=30,
                     headers={"authorization": f"Bearer {platform.api_key}", "x-request-id": "no spaces please"},
                     json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2})
    assert bad.status_code == 400 and "x-request-id" in bad.json()["error"]["message"]
    assert "A-Z a-z 0-9" in bad.json()["error"]["message"]
