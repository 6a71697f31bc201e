"""The router's fields -> TensorRT-LLM's request inputs (common/trtllm_request.py) and the tokenizer file its
guided decoding reads (build_engines/xgrammar_info.py), without Triton."""
from __future__ import annotations

import json

import numpy as np
import pytest

from build_engines import xgrammar_info
from common.trtllm_request import guide, random_seed, sampling_inputs


def test_sampling_fields_become_the_backends_inputs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inputs, stops = sampling_inputs({"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.1,
                                     "min_tokens": 3, "stop_token_ids": [7, 9], "logprobs": True,
                                     "guided": {"type": "json_schema", "schema": schema, "strict": True}})
    assert inputs["presence_penalty"].dtype == np.float32 and inputs["presence_penalty"].shape == (1, 1)
    assert inputs["frequency_penalty"][0, 0] == -0.25 and inputs["repetition_penalty"][0, 0] == np.float32(1.1)
    assert inputs["min_length"].tolist() == [[3]] and inputs["min_length"].dtype == np.int32
    assert inputs["return_log_probs"].tolist() == [[True]]
    assert inputs["guided_decoding_guide_type"].tolist() == [[b"json_schema"]]
    assert json.loads(inputs["guided_decoding_guide"][0, 0]) == schema
    assert stops == [[7], [9]]
    assert guide({"type": "json_object"}) == ("json", "")
    assert guide({"type": "regex", "pattern": r"\d+"}) == ("regex", r"\d+")
    assert sampling_inputs({}) == ({}, [])


def test_what_the_backend_cannot_take_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="min_p, top_logprobs: not supported by TensorRT-LLM"):
        sampling_inputs({"top_logprobs": 3, "min_p": 0.1})
    with pytest.raises(ValueError, match="response_format: type must be"):
        guide({"type": "grammar"})
    with pytest.raises(ValueError, match="seed_offset"):
        random_seed(1, -1)


def test_a_resumed_seeded_stream_gets_its_own_seed() -> None:
    assert random_seed(41, 0) == 41 and random_seed(41, 5) == 46
    assert random_seed(2**64 - 1, 2) == 1   # wraps in the backend's UINT64


def test_xgrammar_tokenizer_info_has_the_backends_keys(smollm2_dir, tmp_path) -> None:
    path = xgrammar_info.write(smollm2_dir, tmp_path)
    info = json.loads(path.read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    tok = json.loads(info["tokenizer_str"])
    assert len(info["encoded_vocab"]) >= len(tok["model"]["vocab"])
    assert info["encoded_vocab"][info["stop_token_ids"][0]] == "<|im_end|>"
    import xgrammar as xgr   # the library TensorRT-LLM builds its tokenizer from: it accepts the file
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
    tinfo = xgr.TokenizerInfo(info["encoded_vocab"], meta["vocab_type"], stop_token_ids=info["stop_token_ids"],
                              add_prefix_space=meta["add_prefix_space"])
    assert tinfo.vocab_size == len(info["encoded_vocab"]) and tinfo.stop_token_ids == info["stop_token_ids"]
