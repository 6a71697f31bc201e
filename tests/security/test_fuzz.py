"""Property-based fuzz of every request field on both frontends (OpenAI HTTP JSON and KServe gRPC), on the
real router and replica: a valid request with exactly one field replaced by an arbitrary value never gets a
5xx, and every refusal is a 4xx whose message names that field. Examples are bounded (valid max_tokens stay
tiny, sizes are small) so the whole fuzz runs in well under a minute."""
from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from tests.security.conftest import MODEL, bearer

pytestmark = pytest.mark.integration
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# A value for max_tokens that is never a long generation: invalid, or 1-4.
few_tokens = st.one_of(st.integers(-2**70, 0), st.integers(1, 4), st.integers(4097, 2**70))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=40),
                    st.sampled_from(["", "²", "0", "2", "batch", "../../etc", "/tmp/x", "1e400", "nan", "-1", "a" * 300]))
values = st.one_of(scalars, st.lists(scalars, max_size=5), st.dictionaries(st.text(max_size=8), scalars, max_size=3))
messages = st.one_of(values, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", ""]),
                                                             "content": st.one_of(st.text(max_size=30), scalars)}),
                                      max_size=4))

HTTP_FIELDS = ["model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "version",
               "adapter", "priority", "deadline_ms", "session", "cache_hint", "messages"]
HTTP_NAMES = {"user": ("user", "session"), "max_completion_tokens": ("max_completion_tokens", "max_tokens"),
              "messages": ("messages",), "prompt": ("prompt", "body")}


@st.composite
def http_case(draw):
    field = draw(st.sampled_from(HTTP_FIELDS))
    chat = field == "messages" or draw(st.booleans())
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    if field in ("max_tokens", "max_completion_tokens"):
        body[field] = draw(st.one_of(few_tokens, scalars))
        if isinstance(body[field], int) and 4 < body[field] <= 4096:
            body[field] = 4
    elif field == "prompt" and not chat:
        body[field] = draw(st.one_of(values, st.lists(st.integers(-2**40, 2**40), max_size=6)))
    else:
        body[field] = draw(messages if field == "messages" else values)
    return ("/v1/chat/completions" if chat else "/v1/completions"), field, body


@FUZZ
@given(case=http_case())
def test_http_fields_fuzz(stack, http, case):
    path, field, body = case
    r = http.post(path, headers=bearer(stack.api_key), content=json.dumps(body).encode())
    assert r.status_code < 500 or (field == "deadline_ms" and r.status_code == 504), (field, body, r.text)
    if r.status_code >= 400:
        message = r.json()["error"]["message"]
        assert any(name in message for name in HTTP_NAMES.get(field, (field,))), (field, body, message)


GRPC_INPUTS = ["text_input", "input_ids", "max_tokens", "temperature", "top_p", "top_k", "random_seed", "stop_words",
               "lora_name", "stream"]
GRPC_PARAMS = ["priority", "tier", "deadline_ms", "adapter", "session", "cache_hint", "version",
               "triton_enable_empty_final_response"]
GRPC_NAMES = {"input_ids": ("input_ids", "text_input", "prompt"), "text_input": ("text_input", "prompt"),
              "lora_name": ("lora_name", "adapter"), "tier": ("tier", "priority"), "stop_words": ("stop_words", "stop"),
              "random_seed": ("random_seed", "seed"), "model_version": ("version",), "model_name": ("model",),
              "max_tokens": ("max_tokens", "prompt")}
CONTENTS = {"bytes_contents": st.lists(st.binary(max_size=20), max_size=4),
            "bool_contents": st.lists(st.booleans(), max_size=4),
            "fp32_contents": st.lists(st.floats(width=32), max_size=4), "fp64_contents": st.lists(st.floats(), max_size=4),
            "int_contents": st.lists(st.integers(-2**31, 2**31 - 1), max_size=4),
            "int64_contents": st.lists(st.integers(-2**63, 2**63 - 1), max_size=4),
            "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=4),
            "uint64_contents": st.lists(st.integers(0, 2**64 - 1), max_size=4)}
DATATYPES = ["BYTES", "BOOL", "FP32", "FP64", "INT32", "INT64", "UINT32", "UINT64", "INT8", "FP16", "nonsense"]


def _base() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=MODEL, id="fuzz")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"Hi")
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1]).contents.int_contents.append(2)
    req.inputs.add(name="temperature", datatype="FP32", shape=[1]).contents.fp32_contents.append(0.0)
    return req


@st.composite
def grpc_case(draw):
    req = _base()
    kind = draw(st.sampled_from(["input", "param", "id", "model_name", "model_version"]))
    if kind == "input":
        field = draw(st.sampled_from(GRPC_INPUTS))
        for i, inp in enumerate(req.inputs):
            if inp.name == field:
                del req.inputs[i]
                break
        inp = req.inputs.add(name=field, datatype=draw(st.sampled_from(DATATYPES)),
                             shape=draw(st.lists(st.integers(-2, 5), max_size=3)))
        contents = draw(st.sampled_from(sorted(CONTENTS)))
        data = draw(CONTENTS[contents])
        if field == "max_tokens":  # never a long generation
            data = [v if not isinstance(v, (int, float)) or not 4 < v <= 4096 else 4 for v in data]
        getattr(inp.contents, contents).extend(data)
    elif kind == "param":
        field = draw(st.sampled_from(GRPC_PARAMS))
        which = draw(st.sampled_from(["string_param", "int64_param", "bool_param", "double_param", "uint64_param"]))
        value = {"string_param": st.text(max_size=40), "int64_param": st.integers(-2**63, 2**63 - 1),
                 "bool_param": st.booleans(), "double_param": st.floats(),
                 "uint64_param": st.integers(0, 2**64 - 1)}[which]
        setattr(req.parameters[field], which, draw(value))
    else:
        field = kind
        setattr(req, kind, draw(st.one_of(st.text(max_size=40), st.sampled_from(["a" * 5000, "../x", "1"]))))
    return field, req


@FUZZ
@given(case=grpc_case())
def test_grpc_fields_fuzz(stack, kserve, case):
    field, req = case
    try:
        kserve.ModelInfer(req, metadata=(("authorization", f"Bearer {stack.api_key}"),), timeout=60)
        return
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    server_side = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                   grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
    assert code not in server_side, (field, code, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert field == "deadline_ms", (field, details)
        return
    assert any(name in details for name in GRPC_NAMES.get(field, (field,))), (field, code, details)
