"""Structured output: grammars (JSON object, JSON schema, regex) as token bitmasks over the vocabulary,
from xgrammar, applied to the logits of the constrained rows of each batched step.

- Compile once: `GrammarCache.compile` turns a request's spec into xgrammar's CompiledGrammar, cached by the
  spec's hash; the Triton shim calls it on its execute thread, never on the engine loop.
- Per sequence a GrammarMatcher (`Guide`) follows the emitted tokens; before each sampling step the masks of
  all constrained rows are filled into one bitmask and applied in one call on the logits (an fp32 copy, the
  same copy the penalties use; outside any captured CUDA graph).
- A stream the router resumes on another replica arrives as prompt + emitted ids with `seed_offset` = the
  number emitted: the new matcher replays those ids first, so the rest still follows the grammar.
- The sequence stops when the matcher has accepted a complete value (or EOS where the grammar allows it).

Spec (the engine's `guided` field): {"type": "json_object"} | {"type": "json_schema", "schema": {...}} |
{"type": "regex", "pattern": "..."}.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

import torch

from common.sampling_fields import spec_problem

CACHE_ENTRIES = 256


class GrammarCache:
    """Compiled grammars of one model's vocabulary, cached by the spec's hash (thread-safe)."""

    def __init__(self, weights_dir: str, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer   # only replicas that get a guided request pay for it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(weights_dir), vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def compile(self, spec: dict):
        problem = spec_problem(spec)
        if problem:
            raise ValueError(problem)
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            if spec["type"] == "json_object":
                grammar = self.compiler.compile_builtin_json_grammar()
            elif spec["type"] == "json_schema":
                # no free whitespace: a small model would otherwise fill max_tokens with it
                grammar = self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                            strict_mode=bool(spec.get("strict", True)))
            else:
                grammar = self.compiler.compile_regex(spec["pattern"])
        except Exception as exc:   # xgrammar's message names the schema/regex problem
            raise ValueError(f"response_format: cannot be compiled: {exc}") from exc
        with self._lock:
            self.compiles += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar


class Guide:
    """One sequence's grammar state."""

    def __init__(self, grammar, replay: list[int]) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar)
        for i, tok in enumerate(replay):
            if not self.matcher.accept_token(tok):
                raise ValueError(f"response_format: resumed output token {i} ({tok}) does not follow the grammar")

    def accept(self, tok: int) -> bool:
        """Accept a sampled token; True when the output is complete (the matcher has terminated)."""
        self.matcher.accept_token(tok)
        return self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, rows: list[int], guides: list[Guide], vocab: int) -> None:
    """Mask, in place, every constrained row's logits to the tokens its grammar allows next."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab)
    for row, guide in zip(rows, guides):
        guide.matcher.fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)
