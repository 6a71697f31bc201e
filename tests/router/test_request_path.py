"""Router logic without servers: rollout stickiness, KServe decoding, field validation."""
import time
from collections import Counter

import numpy as np
import pytest
from tritonclient.grpc import InferInput
from tritonclient.grpc import service_pb2 as pb

from router_service.errors import RouterError
from router_service.kserve_codec import decode_request, encode_response
from router_service.request import Finished, GenerateRequest, TokenDelta
from router_service.rollout import pick_version


def test_rollout_split_is_sticky_and_close_to_the_percentages():
    split = {"1": 70, "2": 30}
    picks = Counter(pick_version(split, f"caller-{i}") for i in range(10_000))
    assert abs(picks["2"] / 10_000 - 0.30) < 0.02
    assert all(pick_version(split, "caller-7") == pick_version(split, "caller-7") for _ in range(5))
    # moving 30 -> 40 % keeps everyone who was on version 2 there
    on_two = {i for i in range(2000) if pick_version(split, f"c{i}") == "2"}
    assert on_two <= {i for i in range(2000) if pick_version({"1": 60, "2": 40}, f"c{i}") == "2"}


def _request(inputs: list[InferInput], **params) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="smollm2-135m", id="r1")
    for inp in inputs:
        req.inputs.append(inp._get_tensor())
        req.raw_input_contents.append(inp._get_content())
    for k, v in params.items():
        if isinstance(v, str):
            req.parameters[k].string_param = v
        elif isinstance(v, bool):
            req.parameters[k].bool_param = v
        else:
            req.parameters[k].int64_param = v
    return req


def _tensor(name, value, dtype, np_dtype):
    t = InferInput(name, [len(value)], dtype)
    t.set_data_from_numpy(np.array(value, dtype=np_dtype))
    return t


def test_kserve_request_decodes_all_fields():
    req = decode_request(_request([
        _tensor("text_input", [b"hello"], "BYTES", object), _tensor("max_tokens", [12], "INT32", np.int32),
        _tensor("temperature", [0.5], "FP32", np.float32), _tensor("stop_words", [b"\n", b"END"], "BYTES", object),
        _tensor("random_seed", [7], "UINT64", np.uint64)], tier="batch", deadline_ms=5000))
    assert (req.prompt_text, req.max_tokens, req.temperature, req.stop, req.seed, req.tier) == \
        ("hello", 12, 0.5, ["\n", "END"], 7, "batch")
    assert req.deadline_ms > time.time() * 1000
    assert not req.ignore_eos


def test_ignore_eos_parameter_reaches_the_request():
    hi = _tensor("text_input", [b"hi"], "BYTES", object)
    assert decode_request(_request([hi], ignore_eos=True)).ignore_eos is True
    with pytest.raises(RouterError, match="ignore_eos: must be a bool"):
        decode_request(_request([hi], ignore_eos="yes"))


@pytest.mark.parametrize("inputs,params,match", [
    ([], {}, "exactly one of text_input"),
    ([_tensor("text_input", [b"hi"], "BYTES", object), _tensor("bogus", [1], "INT32", np.int32)], {}, "bogus: unknown input"),
    ([_tensor("text_input", [b"\xff\xfe"], "BYTES", object)], {}, "text_input: is not valid UTF-8"),
    ([_tensor("text_input", [b"hi"], "BYTES", object), _tensor("max_tokens", [1.5], "FP32", np.float32)], {},
     "max_tokens: datatype FP32 is not allowed"),
    ([_tensor("text_input", [b"hi", b"there"], "BYTES", object)], {}, "text_input: shape \\[2\\]"),
    ([_tensor("text_input", [b"hi"], "BYTES", object)], {"priority": "urgent"}, "priority: 'urgent' is not a tier"),
    ([_tensor("text_input", [b"hi"], "BYTES", object)], {"deadline_ms": -5}, "deadline_ms: must be positive"),
    ([_tensor("text_input", [b"hi"], "BYTES", object)], {"colour": "red"}, "colour: unknown request parameter"),
])
def test_bad_kserve_requests_name_the_field(inputs, params, match):
    with pytest.raises(RouterError, match=match) as info:
        decode_request(_request(inputs, **params))
    assert info.value.code == "invalid_argument"


@pytest.mark.parametrize("field,value,match", [
    ("max_tokens", 0, "max_tokens: must be a positive integer"),
    ("max_tokens", 99999, "max_tokens: 99999 exceeds the model's context of 2048"),
    ("temperature", 3.0, "temperature: must be between 0 and 2"),
    ("top_p", 0.0, "top_p: must be in"),
])
def test_sampling_fields_are_validated(field, value, match):
    req = GenerateRequest(request_id="r", model="m", prompt_text="hi")
    setattr(req, field, value)
    with pytest.raises(RouterError, match=match):
        req.validate(2048)


def test_prompt_over_context_names_both_numbers():
    req = GenerateRequest(request_id="r", model="m", prompt_ids=list(range(2000)), max_tokens=100)
    with pytest.raises(RouterError, match="2000 tokens.*2100, over the model's context of 2048"):
        req.check_prompt_fits(2048)


def test_encoded_final_response_carries_finish_reason_usage_and_final_flag():
    req = GenerateRequest(request_id="r", model="m")
    delta = encode_response(req, "1", TokenDelta("Par", [123]))
    final = encode_response(req, "1", Finished("stop", 10, 0, 3, "m", "1", "rep"))
    assert [o.name for o in delta.outputs] == ["text_output", "output_ids", "finish_reason", "usage"]
    assert "triton_final_response" not in delta.parameters
    assert final.parameters["triton_final_response"].bool_param
    assert np.frombuffer(final.raw_output_contents[3], dtype=np.int32).tolist() == [10, 0, 3]
