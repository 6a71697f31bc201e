"""Prompt tokenisation on the router: chat templates, token counts for validation, ids sent to replicas.

The router sends `input_ids` (not text) upstream so that prompt hashing, context checks and resume
after a replica failure all work on exactly the ids the engine sees.
"""
from __future__ import annotations

import threading
from pathlib import Path

from router_service.errors import RouterError


class TokenizerCache:
    def __init__(self) -> None:
        self._tokenizers: dict[str, object] = {}
        self._limits: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def get(self, weights_dir: str):
        with self._lock:
            tok = self._tokenizers.get(weights_dir)
            if tok is None:
                from transformers import AutoTokenizer  # heavy import, only on first use
                if not Path(weights_dir, "tokenizer.json").exists():
                    raise RouterError("unavailable", f"tokenizer for this model version is missing at {weights_dir}")
                tok = self._tokenizers[weights_dir] = AutoTokenizer.from_pretrained(weights_dir)
            return tok

    def limits(self, weights_dir: str) -> tuple[int, int]:
        """(vocab size, most characters one token can stand for): the bounds the router checks prompts
        against before spending tokeniser time (cached per tokenizer)."""
        with self._lock:
            cached = self._limits.get(weights_dir)
        if cached is None:
            tok = self.get(weights_dir)
            cached = (len(tok), max(len(t) for t in tok.get_vocab()))  # byte-level tokens: len >= decoded chars
            with self._lock:
                self._limits[weights_dir] = cached
        return cached

    def loaded(self, weights_dir: str) -> bool:
        return weights_dir in self._tokenizers

    def encode(self, weights_dir: str, text: str) -> list[int]:
        return list(self.get(weights_dir).encode(text, add_special_tokens=False))

    def encode_chat(self, weights_dir: str, messages: list[dict]) -> list[int]:
        tok = self.get(weights_dir)
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
