"""Red-team round 2 (issue 34), items 1-5, 7 and 8, against the real router + replica of tests/security:
admin routes authenticate from the headers before reading a body (401 before 400, no wait for a declared
50 MB), the published schema hides the admin surface, hostile JSON (100,000-deep nesting, lone UTF-16
surrogates) gets a clear 400 naming the field, the internal listener reads no body from a peer that cannot
sign its head, and a gRPC request whose proto string is not UTF-8 gets INVALID_ARGUMENT naming the field.
Item 6 (special-token text in chat content) is tests/security of the tokenization change."""
from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from common.report_channel import REPLICA_HEADER, REPORT_PATH
from tests.security.conftest import MODEL, bearer

pytestmark = pytest.mark.integration
ADMIN_WRITE = "/admin/models/smollm2-135m/rollout"


def _raw_request(url: str, head: str, wait_s: float = 5.0) -> tuple[float, str]:
    """Send only a request head (no body) and return (seconds until an answer, the answer's status line);
    the body it declares is never sent, as a hostile caller would do."""
    parts = urlsplit(url)
    started = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=wait_s) as sock:
        sock.sendall(head.encode())
        try:
            answer = sock.recv(4096).decode(errors="replace")
        except TimeoutError:
            return time.monotonic() - started, ""
    return time.monotonic() - started, answer.split("\r\n", 1)[0]


def test_an_anonymous_admin_call_declaring_50_mb_is_refused_before_reading(stack):
    took, status = _raw_request(stack.http_url, f"POST {ADMIN_WRITE} HTTP/1.1\r\nhost: x\r\n"
                                                "content-type: application/json\r\ncontent-length: 50000000\r\n\r\n")
    assert status.startswith("HTTP/1.1 401"), status  # before: no answer (the router waited for 50 MB)
    assert took < 3, took


def test_admin_routes_say_401_before_400_and_403_before_reading(stack, http):
    bad = http.post(ADMIN_WRITE, content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 401, bad.text  # before: 400 (the body was validated first)
    wrong = http.put("/admin/warm-buffers/smollm2-135m/1", json={"colour": 1}, headers=bearer("not-a-token"))
    assert wrong.status_code == 401, wrong.text
    with_token = http.post(ADMIN_WRITE, content=b"{not json", headers=bearer(stack.admin_token))
    assert with_token.status_code == 400 and "body" in with_token.json()["error"]["message"]
    big = http.post(ADMIN_WRITE, content=b" " * 300_000, headers=bearer(stack.admin_token))
    assert big.status_code == 413, big.text  # an operator's body is bounded too


def test_the_published_schema_has_no_admin_routes(stack, http):
    schema = http.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]  # the public API stays documented
    assert not [p for p in schema["paths"] if p.startswith("/admin")], sorted(schema["paths"])  # before: 12
    for page in ("/docs", "/redoc"):
        r = http.get(page)
        assert r.status_code == 200 and "/admin" not in r.text


def test_deeply_nested_json_is_a_clear_400(stack, http):
    deep = b'{"model": "smollm2-135m", "prompt": "hi", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = http.post("/v1/completions", content=deep, headers=bearer(stack.api_key))
    assert r.status_code == 400, r.text[:300]  # before: a bare 500 (the parser's recursion limit)
    assert "nested" in r.json()["error"]["message"]
    admin = http.post(ADMIN_WRITE, content=b'{"split": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                      headers=bearer(stack.admin_token))
    assert admin.status_code == 400 and "nested" in admin.json()["error"]["message"], admin.text[:300]
    assert http.post("/v1/completions", headers=bearer(stack.api_key),
                     json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field,body", [
    ("prompt", '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("stop", '{"model": "%s", "prompt": "hi", "stop": ["x", "\\udfff"], "max_tokens": 2}'),
    ("user", '{"model": "%s", "prompt": "hi", "user": "\\ud83d", "max_tokens": 2}'),
    ("messages[0].content", '{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}'),
])
def test_lone_surrogates_are_a_clear_400_naming_the_field(stack, http, field, body):
    path = "/v1/chat/completions" if field.startswith("messages") else "/v1/completions"
    r = http.post(path, content=(body % MODEL).encode(), headers=bearer(stack.api_key))
    assert r.status_code == 400, r.text  # before: 500
    message = r.json()["error"]["message"]
    assert message.startswith(field) and "surrogate" in message, message


def test_internal_listener_reads_no_body_from_a_peer_that_cannot_sign(stack):
    rid = stack.replica_ids[0]  # ids are predictable: a registered one
    took, status = _raw_request(stack.settings.router_internal_url,
                                f"POST {REPORT_PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                f"{REPLICA_HEADER}: {rid}\r\ncontent-length: 32000000\r\n\r\n")
    assert status.startswith("HTTP/1.1 401"), status  # before: it waited to read 32 MB, then checked
    assert took < 3, took
    assert stack.fleet()["replicas"][0]["reporting"]  # the replica's own signed reports still land


def _bad_utf8_infer() -> bytes:
    request = pb.ModelInferRequest(model_name="smollm2-135m", id="bad-utf8")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"Hello")
    return request.SerializeToString().replace(b"smollm2-135m", b"smollm2-\xff\xfe5m")


def test_grpc_non_utf8_proto_string_is_invalid_argument_naming_the_field(stack):
    channel = grpc.insecure_channel(stack.grpc_url)
    try:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b,
                                    response_deserializer=pb.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            infer(_bad_utf8_infer(), metadata=(("authorization", f"Bearer {stack.api_key}"),), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value  # before: UNKNOWN DecodeError
        assert "model_name" in caught.value.details() and "UTF-8" in caught.value.details()
        # on a stream, that request is answered in-band and the next one is served
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       request_serializer=lambda b: b,
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)
        good = pb.ModelInferRequest(model_name=MODEL, id="good")
        tensor = good.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"Hello")
        limit = good.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        limit.contents.int_contents.append(2)
        answers = list(stream(iter([_bad_utf8_infer(), good.SerializeToString()]),
                              metadata=(("authorization", f"Bearer {stack.api_key}"),), timeout=60))
        errors = [a.error_message for a in answers if a.error_message]
        assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0] and "model_name" in errors[0], errors
        assert any(a.infer_response.id == "good" for a in answers if not a.error_message)
    finally:
        channel.close()
