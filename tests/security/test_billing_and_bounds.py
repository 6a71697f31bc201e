"""Issue 12, holes 3, 4 and 5 on the real router and replica: the router's own id is the billing key (the
caller's id only correlates), every input is bounded before work is spent on it, and odd values get a 4xx
naming the field instead of a 500 or 503."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import grpc
import numpy as np
import pytest
from kafka import KafkaConsumer
from tritonclient.grpc import service_pb2 as pb

from tests.security.conftest import MODEL, bearer

pytestmark = pytest.mark.integration


def _infer(kserve, key: str, request_id: str, text: str = "Say hi.", max_tokens: int = 2, **params):
    req = pb.ModelInferRequest(model_name=MODEL, id=request_id)
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(text.encode())
    m = req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    m.contents.int_contents.append(max_tokens)
    for k, v in params.items():
        req.parameters[k].string_param = v
    return kserve.ModelInfer(req, metadata=(("authorization", f"Bearer {key}"),), timeout=60)


def _usage_events(bootstrap: str, topic: str, min_count: int, timeout_s: float = 30) -> list[dict]:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000, group_id=None)
    events, deadline = [], time.monotonic() + timeout_s
    try:
        while len(events) < min_count and time.monotonic() < deadline:
            events += [json.loads(m.value) for m in consumer]
    finally:
        consumer.close()
    return events


def test_caller_request_ids_never_decide_billing(stack, kserve):
    shared = f"dup-{time.time_ns()}"
    replies = [_infer(kserve, stack.api_key, shared) for _ in range(3)]
    assert [r.id for r in replies] == [shared] * 3  # echoed for correlation
    events = [e for e in _usage_events(stack.env["KAFKA_BOOTSTRAP_SERVERS"], stack.settings.usage_topic, 3)
              if e["caller"] == "dev"]
    ids = {e["request_id"] for e in events}
    assert len(ids) >= 3 and shared not in ids  # before: one usage row, two thirds unbilled
    with pytest.raises(grpc.RpcError) as info:  # before: a 1-4 MB id wedged the usage producer
        _infer(kserve, stack.api_key, "x" * 1_000_000)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("id:")


@pytest.mark.parametrize("body,field", [
    ({"prompt": "Hi", "stop": ["x" * 250_000]}, "stop"),
    ({"prompt": "Hi", "stop": ["y" * 200] * 16}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}] * 10_000}, "messages"),
    ({"prompt": "word " * 200_000}, "prompt"),
    ({"prompt": "Hi", "priority": "²"}, "priority"),  # before: 500
    ({"prompt": "Hi", "priority": "1" * 5000}, "priority"),
    ({"prompt": [1, 2, 60_000]}, "prompt"),  # before: 503 after three replicas refused it
    ({"prompt": [1, 2, 2**31]}, "prompt"),  # before: 500
    ({"prompt": [5] * 5000}, "prompt"),
    ({"prompt": "Hi", "top_k": 2**40}, "top_k"),
    ({"prompt": "Hi", "session": "s" * 10_000}, "session"),
    ({"prompt": "Hi", "deadline_ms": 1e300}, "deadline_ms"),
    ({"prompt": "Hi", "user": "u" * 100_000}, "user"),  # before: named `session`, the field it fills
    ({"messages": [{"role": "user", "content": "hi", "name": "n" * 10_000}]}, "messages.0.name"),
    # a 2 KB schema of distinct length bounds held a replica's compile for ~30 s (64 KB: many minutes)
    ({"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 1000 + i} for i in range(40)}}}}},
     "response_format"),
])
def test_unbounded_or_odd_inputs_get_a_4xx_naming_the_field(stack, http, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    started = time.monotonic()
    r = http.post(path, headers=bearer(stack.api_key), json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"{field}:"), r.text
    assert time.monotonic() - started < 5  # refused before tokenising or generating


def test_body_size_is_checked_before_the_body_is_read(stack):
    url = urlparse(stack.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + stack.api_key.encode() + b"\r\nContent-Length: 100000000\r\n\r\n{")
        reply = b""
        while b'"}}' not in reply:  # the JSON error body; before: the router waited for all 100 MB
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "body:" in reply


def test_streamed_body_over_the_cap_is_cut_off(stack, http):
    def chunks():
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(50):
            yield b"a" * 100_000
        yield b'"}'
    r = http.post("/v1/completions", headers=bearer(stack.api_key), content=chunks())
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("body:")


def test_grpc_bounds_and_odd_values(stack, kserve):
    for params, field in (({"tier": "²"}, "priority"), ({"deadline_ms": "inf"}, "deadline_ms")):
        with pytest.raises(grpc.RpcError) as info:
            _infer(kserve, stack.api_key, "odd", **params)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(field)
    req = pb.ModelInferRequest(model_name=MODEL)
    ids = req.inputs.add(name="input_ids", datatype="INT64", shape=[2])
    ids.contents.int64_contents.extend([1, 2**40])
    with pytest.raises(grpc.RpcError) as info:  # before: 500 (INT32 overflow on the way to the replica)
        kserve.ModelInfer(req, metadata=(("authorization", f"Bearer {stack.api_key}"),), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in info.value.details()
    stop = pb.ModelInferRequest(model_name=MODEL)
    t = stop.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    t.contents.bytes_contents.append(b"Hi")
    s = stop.inputs.add(name="stop_words", datatype="BYTES", shape=[16])
    s.contents.bytes_contents.extend([b"z" * 250_000] * 16)
    with pytest.raises(grpc.RpcError) as info:  # before: accepted, 62 ms per token for every stream
        kserve.ModelInfer(stop, metadata=(("authorization", f"Bearer {stack.api_key}"),), timeout=30)
    assert info.value.details().startswith("stop:")
    assert _infer(kserve, stack.api_key, "still-serving").id == "still-serving"


def test_registry_refusals_reach_the_admin_caller_as_400(stack, http):
    r = http.post(f"/admin/models/{MODEL}/rollout", headers=bearer(stack.admin_token),
                  json={"version": "1", "percent": 50})  # nothing else can take the other 50 %
    assert r.status_code == 400 and "remaining 50 %" in r.json()["error"]["message"]  # before: bare 500
    r = http.post(f"/admin/models/{MODEL}/rollout", headers=bearer(stack.admin_token), json={"split": {"7": 100}})
    assert r.status_code == 400 and "no version '7'" in r.json()["error"]["message"]
