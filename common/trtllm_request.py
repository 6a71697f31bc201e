"""The router's per-request fields -> TensorRT-LLM's optional request inputs (the GPU preprocessing's mapping).

Pure numpy, so it is tested without Triton; model_repository/gpu/preprocessing wraps the arrays in tensors.
Names and shapes follow tensorrtllm_backend's `tensorrt_llm/config.pbtxt` (batch dim 1 explicit here):

- `ignore_eos` -> `end_id` = -1 (no end id, as TensorRT-LLM's own ignore_eos) and no EOS stop words;
- `random_seed` + `seed_offset` (a resumed seeded stream) -> `random_seed` = seed + offset (mod 2^64): the
  resumed part draws from its own stream, not the uninterrupted one's;
- `presence_penalty`, `frequency_penalty`, `repetition_penalty` -> the inputs of the same names (FP32);
- `min_tokens` -> `min_length`; `stop_token_ids` -> one-token words in `stop_words_list`;
- `logprobs` -> `return_log_probs`; `output_log_probs` then comes back with each response;
- `guided` (response_format) -> `guided_decoding_guide_type` json / json_schema / regex and
  `guided_decoding_guide` (tensorrtllm_backend >= 0.19, model parameter `guided_decoding_backend: xgrammar`).

Fields not listed (top_logprobs, logit_bias, min_p) are refused by the router before a GPU replica is called
(router_service/upstream.py, with GPU_FIELDS); here they are an error naming the field.
"""
from __future__ import annotations

import json

import numpy as np

from common.sampling_fields import spec_problem

NO_END_ID = -1   # TensorRT-LLM: generate to request_output_len whatever the model emits
GUIDE_TYPES = {"json_object": "json", "json_schema": "json_schema", "regex": "regex"}
_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
GPU_FIELDS = frozenset({*_FLOATS, "min_tokens", "stop_token_ids", "logprobs", "guided"})


def _one(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def random_seed(seed: int, seed_offset: int) -> int:
    """The seed of this attempt: a resumed stream (seed_offset = tokens already emitted) gets its own."""
    if not 0 <= seed_offset < 2**31:
        raise ValueError(f"seed_offset must be in [0, 2^31), got {seed_offset}")
    return (int(seed) + seed_offset) % 2**64


def guide(spec: dict) -> tuple[str, str]:
    """(guided_decoding_guide_type, guided_decoding_guide) of the router's structured-output spec."""
    problem = spec_problem(spec)
    if problem:
        raise ValueError(problem)
    kind = GUIDE_TYPES[spec["type"]]
    if kind == "json":
        return kind, ""
    if kind == "json_schema":
        return kind, json.dumps(spec["schema"], separators=(",", ":"))
    return kind, spec["pattern"]


def sampling_inputs(sampling: dict) -> tuple[dict[str, np.ndarray], list[list[int]]]:
    """(tensorrt_llm inputs by name, extra one-token stop words) of the router's `sampling` parameter."""
    unknown = sorted(set(sampling) - GPU_FIELDS)
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported by TensorRT-LLM replicas; supported: "
                         f"{', '.join(sorted(GPU_FIELDS))}")
    out: dict[str, np.ndarray] = {}
    for name in _FLOATS:
        if name in sampling:
            out[name] = _one(float(sampling[name]), np.float32)
    if "min_tokens" in sampling:
        out["min_length"] = _one(int(sampling["min_tokens"]), np.int32)
    if sampling.get("logprobs"):
        out["return_log_probs"] = _one(True, np.bool_)
    if sampling.get("guided"):
        kind, text = guide(sampling["guided"])
        out["guided_decoding_guide_type"] = np.array([[kind.encode()]], dtype=object)
        if text:
            out["guided_decoding_guide"] = np.array([[text.encode()]], dtype=object)
    stops = [[int(i)] for i in sampling.get("stop_token_ids", [])]
    return out, stops
