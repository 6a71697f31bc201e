"""Prompt tokenisation on the router: chat templates, token counts for validation, ids sent to replicas.

The router sends `input_ids` (not text) upstream so that prompt hashing, context checks and resume
after a replica failure all work on exactly the ids the engine sees.

The model's tokenizer decides the special tokens: a completion prompt gets what its config adds (BOS for
Llama/Gemma-style tokenizers, nothing for SmolLM2), a chat prompt what its chat template writes. Only the
template may produce control tokens: text in a message that spells one (`<|im_end|>`) is tokenized as
plain text, so a caller cannot forge a system turn (OpenAI's API and tiktoken's default do the same).
Tools and tool-call history: rendered by the template when it reads `tools`, else written into the messages
as text (router_service/tools.py); what a template renders outside the contents must not spell a control token.
"""
from __future__ import annotations

import functools
import json
import re
import secrets
import threading
from pathlib import Path

from router_service.errors import RouterError, invalid
from router_service.tools import for_template, supports_tools as tools_supported


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
        """A completion prompt, with the special tokens the tokenizer's config adds (e.g. BOS)."""
        return list(self.get(weights_dir).encode(text, add_special_tokens=True))

    def encode_chat(self, weights_dir: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return encode_chat(self.get(weights_dir), messages, tools)


def _render(tok, messages: list[dict], tools: list[dict] | None = None) -> str:
    try:
        return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:   # jinja's TemplateError (raise_exception in the template), or its own bugs
        raise invalid("messages", f"the model's chat template refused them: {type(exc).__name__}: {exc}") from exc


def encode_chat(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat prompt's ids: the template's own text with its control tokens, each message's content as
    text only (special-token spellings split into ordinary tokens).

    The template is rendered with a random marker in place of each content; the text between markers is
    tokenized with special tokens, each content without. If the template transforms contents (so the
    markers do not stand for them verbatim), the real rendering is tokenized instead, and a content that
    spells a control token is refused rather than tokenized as one."""
    if not getattr(tok, "chat_template", None):
        raise invalid("messages", "this model version has no chat template, so chat is not available; use "
                                  "/v1/completions with a prompt in the model's own format")
    native = tools_supported(tok)
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages, tools = for_template(messages, tools, native)
    if native:   # these are rendered outside the contents: they must not smuggle a control token in
        specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
        for what, value in (("tools", tools), ("messages", [m.get("tool_calls") for m in messages])):
            text = json.dumps(value) if value else ""
            hit = next((s for s in specials if s in text), None)
            if hit is not None:
                raise invalid(what, f"contains the control token text {hit!r}; remove it")
    render = functools.partial(_render, tools=tools)
    nonce = secrets.token_hex(8)
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(tok, marked))
    rendered = render(tok, messages)
    pieces = [messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(parts)]
    if "".join(pieces) == rendered:
        spans, at = [], 0   # where each content lies in the rendering
        for k, piece in enumerate(pieces):
            if k % 2:
                spans.append((at, at + len(piece)))
            at += len(piece)
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        if not any(t in special and any(a <= start < b for a, b in spans)
                   for t, (start, _) in zip(enc["input_ids"], enc["offset_mapping"])):
            return list(enc["input_ids"])   # the usual case: exactly the template's own tokenization
        ids: list[int] = []   # a content spells a control token: tokenize it apart, as text
        for k, part in enumerate(parts):
            if k % 2 == 0:
                ids += tok.encode(part, add_special_tokens=False)
            else:
                ids += tok.encode(messages[int(part)]["content"], add_special_tokens=False, split_special_tokens=True)
        return ids
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    for i, m in enumerate(messages):
        hit = next((s for s in specials if s in m["content"]), None)
        if hit is not None:
            raise invalid(f"messages[{i}].content", f"contains the control token text {hit!r}, which this model's "
                                                   "template does not pass through verbatim; remove it")
    return list(tok.encode(rendered, add_special_tokens=False))
