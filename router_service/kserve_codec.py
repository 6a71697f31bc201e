"""KServe v2 protobuf <-> router types: decode a ModelInferRequest into a GenerateRequest and
encode streamed deltas as ModelInferResponses (tensor names: docs/architecture.md, Replica interface)."""
from __future__ import annotations

import json
import struct
import uuid
from array import array

import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from common.names import CLIENT_ID_RE, CLIENT_ID_RULE
from router_service.errors import RouterError, invalid
from router_service.request import TIERS, Finished, GenerateRequest, TokenDelta

# input name -> (allowed datatypes, scalar?)
INPUTS = {
    "text_input": ({"BYTES"}, True), "input_ids": ({"INT32", "INT64"}, False),
    "max_tokens": ({"INT32", "INT64", "UINT32", "UINT64"}, True), "temperature": ({"FP32", "FP64"}, True),
    "top_p": ({"FP32", "FP64"}, True), "top_k": ({"INT32", "INT64", "UINT32", "UINT64"}, True),
    "random_seed": ({"UINT64", "INT64", "INT32", "UINT32"}, True), "stop_words": ({"BYTES"}, False),
    "lora_name": ({"BYTES"}, True), "stream": ({"BOOL"}, True),
}
# OpenAI sampling fields as request parameters (same names; docs/api.md): type each must have
SAMPLING_PARAMETERS = {"logprobs": bool, "top_logprobs": int, "presence_penalty": float, "frequency_penalty": float,
                       "repetition_penalty": float, "min_p": float, "min_tokens": int, "logit_bias": str,
                       "stop_token_ids": str, "response_format": str}
PARAMETERS = {"priority", "tier", "deadline_ms", "adapter", "session", "version",
              "ignore_eos", "triton_enable_empty_final_response", *SAMPLING_PARAMETERS}
_CONTENTS_FIELD = {"BYTES": "bytes_contents", "BOOL": "bool_contents", "FP32": "fp32_contents",
                   "FP64": "fp64_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "UINT32": "uint_contents", "UINT64": "uint64_contents"}


def _param_value(p: pb.InferParameter):
    return getattr(p, p.WhichOneof("parameter_choice")) if p.WhichOneof("parameter_choice") else None


def _tensor(request: pb.ModelInferRequest, index: int) -> np.ndarray:
    inp = request.inputs[index]
    allowed, scalar = INPUTS[inp.name]
    if inp.datatype not in allowed:
        raise invalid(inp.name, f"datatype {inp.datatype} is not allowed; use {' or '.join(sorted(allowed))}")
    count = int(np.prod(inp.shape)) if len(inp.shape) else 1
    if scalar and count != 1:
        raise invalid(inp.name, f"shape {list(inp.shape)} must hold exactly one element")
    try:
        if request.raw_input_contents:
            raw = request.raw_input_contents[index]
            if inp.datatype == "BYTES":
                arr = deserialize_bytes_tensor(raw)
            else:
                arr = np.frombuffer(raw, dtype=triton_to_np_dtype(inp.datatype))
        else:
            arr = np.array(list(getattr(inp.contents, _CONTENTS_FIELD[inp.datatype])),
                           dtype=object if inp.datatype == "BYTES" else triton_to_np_dtype(inp.datatype))
    except Exception as exc:
        raise invalid(inp.name, f"tensor data could not be decoded ({exc})") from exc
    if arr.size != count:
        raise invalid(inp.name, f"shape {list(inp.shape)} says {count} elements but the data holds {arr.size}")
    return arr.reshape(-1)


def _text(value, field: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise invalid(field, f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    return str(value)


def decode_request(request: pb.ModelInferRequest) -> GenerateRequest:
    tensors: dict[str, np.ndarray] = {}
    for i, inp in enumerate(request.inputs):
        if inp.name not in INPUTS:
            raise invalid(inp.name, f"unknown input; allowed inputs: {', '.join(INPUTS)}")
        tensors[inp.name] = _tensor(request, i)
    params = {k: _param_value(v) for k, v in request.parameters.items()}
    unknown = set(params) - PARAMETERS
    if unknown:
        raise invalid(sorted(unknown)[0], f"unknown request parameter; allowed: {', '.join(sorted(PARAMETERS))}")
    if ("text_input" in tensors) == ("input_ids" in tensors):
        raise invalid("text_input", "send exactly one of text_input (BYTES[1]) or input_ids (INT32[-1])")
    if request.id and not CLIENT_ID_RE.match(request.id):
        raise invalid("id", f"the request id may have {CLIENT_ID_RULE}")
    # the caller's id is only echoed back; billing and de-duplication use the router's own unique id
    req = GenerateRequest(request_id="req-" + uuid.uuid4().hex, client_id=request.id, model=request.model_name,
                          version=request.model_version or (str(params["version"]) if params.get("version") else None))
    if "text_input" in tensors:
        req.prompt_text = _text(tensors["text_input"][0], "text_input")
        if not req.prompt_text.strip():
            raise invalid("text_input", "the prompt is empty")
    else:
        req.prompt_ids = [int(x) for x in tensors["input_ids"]]
    if "max_tokens" in tensors:
        req.max_tokens = int(tensors["max_tokens"][0])
    if "temperature" in tensors:
        req.temperature = float(tensors["temperature"][0])
    if "top_p" in tensors:
        req.top_p = float(tensors["top_p"][0])
    if "top_k" in tensors:
        req.top_k = int(tensors["top_k"][0])
    if "random_seed" in tensors:
        req.seed = int(tensors["random_seed"][0])
    if "stop_words" in tensors:
        req.stop = [_text(s, "stop_words") for s in tensors["stop_words"]]
    if "lora_name" in tensors:
        req.adapter = _text(tensors["lora_name"][0], "lora_name")
    req.adapter = str(params.get("adapter") or req.adapter)
    req.tier = tier_from_param(params.get("tier", params.get("priority")))
    if params.get("deadline_ms") is not None:
        req.deadline_ms = deadline_from_param(params["deadline_ms"])
    req.session = str(params.get("session") or "")
    if params.get("ignore_eos") is not None:
        if not isinstance(params["ignore_eos"], bool):
            raise invalid("ignore_eos", "must be a bool parameter (true: generate max_tokens even past end-of-sequence)")
        req.ignore_eos = params["ignore_eos"]
    _sampling_parameters(req, params)
    return req


def _sampling_parameters(req: GenerateRequest, params: dict) -> None:
    """logprobs (bool), top_logprobs/min_tokens (int), penalties/min_p (double or int), logit_bias (JSON object
    string {"token id": bias}), stop_token_ids (comma-separated ids)."""
    for name, kind in SAMPLING_PARAMETERS.items():
        value = params.get(name)
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise invalid(name, f"must be a {kind.__name__} parameter, got {type(value).__name__}")
        if name == "logit_bias":
            try:
                bias = json.loads(value)
                value = {int(k): float(v) for k, v in bias.items()}
            except (ValueError, TypeError, AttributeError, RecursionError) as exc:
                raise invalid(name, 'must be a JSON object {"token id": bias}') from exc
        elif name == "response_format":   # the engine's spec as JSON: {"type": "json_schema", "schema": {...}}
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise invalid(name, 'must be JSON such as {"type": "json_schema", "schema": {...}}') from exc
            name = "guided"
        elif name == "stop_token_ids":
            try:
                value = [int(t) for t in value.split(",") if t.strip()][:1000]
            except ValueError as exc:
                raise invalid(name, "must be comma-separated token ids") from exc
        setattr(req, name, value)


def tier_from_param(value) -> str:
    """`priority`/`tier` as a tier name, or as an integer 0 interactive, 1 standard, 2 batch."""
    if value is None or value == "":
        return "standard"
    if isinstance(value, str) and value in TIERS:
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 4:
        index = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        index = value
    else:
        raise invalid("priority", f"{str(value)[:32]!r} is not a tier; allowed: {', '.join(TIERS)} (or 0, 1, 2)")
    if not 0 <= index < len(TIERS):
        raise invalid("priority", f"{index} is out of range; allowed: 0 interactive, 1 standard, 2 batch")
    return TIERS[index]


def deadline_from_param(value) -> int:
    """deadline_ms: absolute unix epoch milliseconds; values below 10^12 are read as relative ms from now."""
    import time
    try:
        ms = int(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise invalid("deadline_ms", f"must be an integer number of milliseconds, got {str(value)[:32]!r}") from exc
    if ms <= 0:
        raise invalid("deadline_ms", f"must be positive, got {ms}")
    now_ms = int(time.time() * 1000)
    absolute = ms if ms >= 10**12 else now_ms + ms
    if absolute > now_ms + 7 * 24 * 3600 * 1000:
        raise invalid("deadline_ms", "is more than 7 days away")
    return absolute


def _bytes_tensor(values: list[bytes]) -> bytes:
    return serialize_byte_tensor(np.array(values, dtype=np.object_)).item()


def _bytes1(value: bytes) -> bytes:
    """One-element BYTES tensor in Triton's raw layout: 4-byte little-endian length, then the bytes."""
    return struct.pack("<I", len(value)) + value


def _prototype() -> pb.ModelStreamInferResponse:
    proto = pb.ModelStreamInferResponse()
    for name, dtype, shape in (("text_output", "BYTES", [1]), ("output_ids", "INT32", [0]),
                               ("finish_reason", "BYTES", [1]), ("usage", "INT32", [3])):
        proto.infer_response.outputs.add(name=name, datatype=dtype, shape=shape)
    return proto


_PROTOTYPE = _prototype()


def encode_stream_response(req: GenerateRequest, version: str, item: TokenDelta | Finished
                           ) -> pb.ModelStreamInferResponse:
    """One streamed response (hot path: copied from a prototype, no numpy; ~6 us)."""
    if isinstance(item, TokenDelta):
        text, ids, reason, usage = item.text, item.token_ids, "", (0, 0, 0)
    else:
        text, ids, reason = "", [], item.finish_reason
        usage = (item.prompt_tokens, item.cached_prompt_tokens, item.completion_tokens)
    out = pb.ModelStreamInferResponse()
    out.CopyFrom(_PROTOTYPE)
    resp = out.infer_response
    resp.model_name, resp.model_version, resp.id = req.model, version, req.client_id or req.request_id
    resp.outputs[1].shape[0] = len(ids)
    resp.raw_output_contents.extend((_bytes1(text.encode()), array("i", ids).tobytes(), _bytes1(reason.encode()),
                                     array("i", usage).tobytes()))
    if isinstance(item, TokenDelta) and item.logprobs is not None:   # asked for with the logprobs parameters
        _add_logprob_outputs(resp, item.logprobs)
    if isinstance(item, Finished):
        resp.parameters["triton_final_response"].bool_param = True
    return out


def _add_logprob_outputs(resp: pb.ModelInferResponse, logprobs: list) -> None:
    """output_logprobs FP32 [n] (each id's), top_logprob_ids INT32 / top_logprobs FP32 [n * top_logprobs]."""
    chosen = [lp for lp, _ in logprobs]
    ids = [t for _, top in logprobs for t, _ in top]
    lps = [v for _, top in logprobs for _, v in top]
    for name, dtype, values, code in (("output_logprobs", "FP32", chosen, "f"), ("top_logprob_ids", "INT32", ids, "i"),
                                      ("top_logprobs", "FP32", lps, "f")):
        resp.outputs.add(name=name, datatype=dtype, shape=[len(values)])
        resp.raw_output_contents.append(array(code, values).tobytes())


def encode_response(req: GenerateRequest, version: str, item: TokenDelta | Finished) -> pb.ModelInferResponse:
    return encode_stream_response(req, version, item).infer_response


def merge_responses(req: GenerateRequest, version: str, items: list[TokenDelta | Finished]) -> pb.ModelInferResponse:
    """Unary inference: the whole completion as one response."""
    text = "".join(i.text for i in items if isinstance(i, TokenDelta))
    ids = [t for i in items if isinstance(i, TokenDelta) for t in i.token_ids]
    final = next((i for i in items if isinstance(i, Finished)), None)
    if final is None:
        raise RouterError("internal", "generation ended without a final response")
    resp = encode_response(req, version, final)
    resp.raw_output_contents[0] = _bytes_tensor([text.encode()])
    resp.outputs[1].shape[:] = [len(ids)]
    resp.raw_output_contents[1] = np.array(ids, dtype=np.int32).tobytes()
    del resp.parameters["triton_final_response"]
    return resp
