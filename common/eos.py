"""The end-of-sequence ids of a model, and TensorRT-LLM's stop-words tensor that makes a GPU stream stop on each.

Chat models list several EOS ids: Llama-3.1-Instruct's generation_config.json has `eos_token_id: [128001,
128008, 128009]` (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`) and its tokenizer_config.json names
`<|eot_id|>` as `eos_token`. TensorRT-LLM takes one `end_id`; the GPU preprocessing passes the first and puts
every other one in `stop_words_list`, so a turn ending in `<|eot_id|>` ends the stream there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_EOS = 2  # the SmolLM2/Llama-2 convention, used only when the model folder names none


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def eos_token_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """Every EOS id of the model, generation_config.json's first (in its order), then tokenizer_config.json's
    `eos_token` when it is another token; [DEFAULT_EOS] when neither names one."""
    folder = Path(model_dir)
    listed = _read(folder / "generation_config.json").get("eos_token_id")
    ids = [int(i) for i in (listed if isinstance(listed, list) else [listed] if listed is not None else [])]
    token = _read(folder / "tokenizer_config.json").get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if token:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids or [DEFAULT_EOS]


def stop_words_tensor(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's stop_words_list [1, 2, L]: flat ids, then cumulative end offsets padded with -1."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        if word:
            ids += word
            offsets.append(len(ids))
    n = max(len(ids), 1)
    flat = np.array(ids + [0] * (n - len(ids)), dtype=np.int32)
    offs = np.array(offsets + [-1] * (n - len(offsets)), dtype=np.int32)
    return np.stack([flat, offs])[None, :, :]
