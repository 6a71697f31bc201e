"""Stop strings matched on decoded text, with hold-back so the stop string itself is never emitted, in
constant work per token whatever the output's length.

Output is token ids (the router or postprocessing detokenises), so text can only be released a whole token at
a time. Each new token is decoded incrementally (common.text.IncrementalDetokenizer: a short window, never
the whole output), and only the new text plus the last `longest stop - 1` characters before it are searched,
since a stop string that ends in the new text starts at most that far back. If a stop string occurs, the
sequence stops and only the tokens whose text lies wholly before it are released. Otherwise the tokens that
could be the beginning of a stop string (the text's longest suffix that is a prefix of some stop string) are
held back until a later token resolves them. Token -> text offset lookups are a bisection.
"""
from __future__ import annotations

from bisect import bisect_right

from tokenizers import Tokenizer

from common.text import IncrementalDetokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=1)
        self.prefix_lens: list[int] = [0]     # characters of text after k tokens, k = 0..n (non-decreasing)
        self.tail = ""                        # the text's last characters (at most longest - 1 kept between tokens)

    def update(self, output_ids: list[int]) -> tuple[int, bool]:
        """After appending a token: (number of output tokens safe to release, stop string hit?)."""
        new = ""
        for tok in output_ids[len(self.prefix_lens) - 1:]:
            piece = self.detok.add([tok])
            new += piece
            self.prefix_lens.append(self.prefix_lens[-1] + len(piece))
        length = self.prefix_lens[-1]
        window = self.tail + new
        base = length - len(window)           # the window's offset in the whole text
        hit = min((p for p in (window.find(s) for s in self.stops) if p >= 0), default=-1)
        if hit >= 0:
            return self._tokens_within(base + hit), True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(window)), 0, -1):
                if window.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.tail = window[-(self.longest - 1):] if self.longest > 1 else ""
        return self._tokens_within(length - hold), False

    def _tokens_within(self, chars: int) -> int:
        """The most tokens whose text ends at or before `chars`."""
        return bisect_right(self.prefix_lens, chars) - 1
