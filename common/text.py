"""Tokenizer helpers shared by the Triton pre/post-processing models and the router.

Uses the `tokenizers` library directly (fast, no transformers import in the hot Triton models);
chat templating stays with transformers on the router side.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting multi-byte characters.

    Decodes a short window (ids since the last emitted boundary) rather than the whole sequence, and
    holds text back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: ids before it are already final text
        self.read_offset = 0    # ids before it have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end) once the stream ends."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]
