"""Structured output: grammars (JSON object, JSON schema, regex) as token bitmasks over the vocabulary,
from xgrammar, applied to the logits of the constrained rows of each batched step.

- Compile once: `GrammarCache.compile` turns a request's spec into xgrammar's CompiledGrammar, cached by the
  spec's hash (bounded in bytes: a compiled grammar holds its token-mask cache, up to ~150 MB for a large
  schema). The Triton shim calls `compile_later`: the replica's one compile thread does the work (xgrammar
  releases the GIL), so neither Triton's execute thread (every new request of the replica) nor the engine
  loop waits on a slow schema; at most MAX_PENDING_COMPILES wait for it, more are refused as busy. What makes
  a compile slow is bounded by common/sampling_fields.spec_problem (distinct length and repetition bounds).
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
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from common.sampling_fields import spec_problem

log = logging.getLogger(__name__)
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")   # "[07:27:48] /project/cpp/x.cc:4950: " (a build path)
CACHE_BYTES = 512 << 20         # compiled grammars kept per replica
MAX_PENDING_COMPILES = 4        # requests waiting for the compile thread (beyond: refused, retry elsewhere)


class GrammarCache:
    """Compiled grammars of one model's vocabulary, cached by the spec's hash (thread-safe)."""

    def __init__(self, weights_dir: str, vocab_size: int, cache_bytes: int = CACHE_BYTES,
                 max_pending: int = MAX_PENDING_COMPILES) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer   # only replicas that get a guided request pay for it

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(weights_dir), vocab_size=vocab_size)
        # xgrammar's own cache is unbounded by default: ours is bounded in bytes instead
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_bytes, self.max_pending = cache_bytes, max_pending
        self._cache: OrderedDict[str, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.pending = 0
        self.compiles = 0

    @staticmethod
    def key(spec: dict) -> str:
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    def cached(self, spec: dict):
        """The compiled grammar of `spec` if it is in the cache, else None."""
        key = self.key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            self._cache.move_to_end(key)
            return hit[0]

    def compile_later(self, spec: dict, done: Callable[[object | None, str], None]) -> None:
        """Call done(grammar, "") once `spec` is compiled (at once when cached), or done(None, problem) when it
        is refused: malformed, not compilable, or MAX_PENDING_COMPILES already wait for the compile thread."""
        problem = spec_problem(spec)
        hit = None if problem else self.cached(spec)
        if problem or hit is not None:
            return done(hit, problem)
        with self._lock:
            if self.pending >= self.max_pending:
                busy = True
            else:
                busy, self.pending = False, self.pending + 1
        if busy:
            return done(None, f"busy: {self.max_pending} structured-output grammars are compiling on this "
                              "replica; retry")

        def work() -> None:
            try:
                grammar, error = self.compile(spec), ""
            except ValueError as exc:
                grammar, error = None, str(exc)
            finally:
                with self._lock:
                    self.pending -= 1
            done(grammar, error)
        self._worker.submit(work)

    def compile(self, spec: dict):
        problem = spec_problem(spec)
        if problem:
            raise ValueError(problem)
        hit = self.cached(spec)
        if hit is not None:
            return hit
        started = time.monotonic()
        try:
            if spec["type"] == "json_object":
                grammar = self.compiler.compile_builtin_json_grammar()
            elif spec["type"] == "json_schema":
                # no free whitespace: a small model would otherwise fill max_tokens with it
                grammar = self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                            strict_mode=bool(spec.get("strict", True)))
            else:
                grammar = self.compiler.compile_regex(spec["pattern"])
        except Exception as exc:   # xgrammar's message names the schema/regex problem (its log prefix dropped)
            raise ValueError(f"response_format: cannot be compiled: {_XGR_PREFIX.sub('', str(exc)).strip()}") from exc
        seconds, size = time.monotonic() - started, int(grammar.memory_size_bytes)
        if seconds > 1.0:
            log.info("grammar compiled in %.1f s (%d KB; %s)", seconds, size // 1024, spec["type"])
        with self._lock:
            self.compiles += 1
            self._cache[self.key(spec)] = (grammar, size)
            while len(self._cache) > 1 and sum(n for _, n in self._cache.values()) > self.cache_bytes:
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
