"""A GPU stream of a Llama-3-Instruct model ends at <|eot_id|>: the preprocessing's end_id and stop_words_list,
built from real tokenizer files (a tokenizer.json with Llama-3's special tokens, its tokenizer_config.json and
generation_config.json, written here), applied with TensorRT-LLM's stop rule as the stand-in backend applies it
(tests/gpu/standin/model.py `_admit` / `_generate`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from common.eos import DEFAULT_EOS, eos_token_ids, stop_words_tensor
from common.text import load_tokenizer

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]


def _llama3_instruct_files(folder: Path) -> Path:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + ["[UNK]", "Paris", "is", "the", "capital", "."])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    # as Meta's Llama-3.1-8B-Instruct ships them (ids of this small vocabulary instead of 128001/128008/128009)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, 2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|eot_id|>"}))
    return folder


def _stream(generated: list[int], end_id: int, stop_words_list: np.ndarray, max_new: int = 64) -> list[int]:
    """TensorRT-LLM's rule: stop on end_id (not streamed) or once the output ends with a stop word."""
    flat, offsets = stop_words_list.reshape(2, -1)
    stops, start = [], 0
    for end in offsets:
        if end < 0:
            break
        stops.append(flat[start:end].tolist())
        start = int(end)
    out: list[int] = []
    for token in generated:
        if token == end_id:
            break
        out.append(token)
        if len(out) >= max_new or any(s and out[-len(s):] == s for s in stops):
            break
    return out


def test_a_llama3_instruct_stream_ends_at_eot_id(tmp_path) -> None:
    folder = _llama3_instruct_files(tmp_path / "llama3-instruct")
    tok = load_tokenizer(folder)
    eos = eos_token_ids(folder, tok)
    assert eos == [tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    end_id, extra = eos[0], [[i] for i in eos[1:]]
    tensor = stop_words_tensor(extra + [tok.encode("capital", add_special_tokens=False).ids])
    assert tensor.shape[:2] == (1, 2) and tensor.dtype == np.int32
    answer = tok.encode("Paris is the capital .", add_special_tokens=False).ids
    eot = tok.token_to_id("<|eot_id|>")
    # the model answers, ends its turn with <|eot_id|>, and would ramble on: the stream stops at the turn's end
    out = _stream(answer + [eot] + answer, end_id, stop_words_tensor(extra))
    assert out == answer + [eot]
    assert tok.decode(out, skip_special_tokens=True) == "Paris is the capital ."
    # a request's own stop string still works beside the EOS ids
    assert _stream(answer, end_id, tensor) == answer[:4]


def test_single_eos_models_and_models_without_a_generation_config(tmp_path) -> None:
    folder = _llama3_instruct_files(tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert eos_token_ids(folder, load_tokenizer(folder)) == [3]  # the same token named twice counts once
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    assert eos_token_ids(folder, load_tokenizer(folder)) == [DEFAULT_EOS]
    assert stop_words_tensor([]).tolist() == [[[0], [-1]]]  # what the backend reads as "no stop words"
