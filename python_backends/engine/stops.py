"""Stop strings matched on decoded text, with hold-back so the stop string itself is never emitted.

Output is token ids (postprocessing detokenises), so text can only be released a whole token at a time.
After each new token the generated text is decoded; if a stop string occurs, the sequence stops and only the
tokens whose text lies wholly before the stop string are released. Otherwise the tokens that could be the
beginning of a stop string (the text's longest suffix that is a prefix of some stop string) are held back
until a later token resolves them.
"""
from __future__ import annotations

from tokenizers import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.prefix_lens: list[int] = [0]     # len(decode(ids[:k])) for k = 0..n

    def update(self, output_ids: list[int]) -> tuple[int, bool]:
        """After appending a token: (number of output tokens safe to release, stop string hit?)."""
        while len(self.prefix_lens) <= len(output_ids):
            k = len(self.prefix_lens)
            self.prefix_lens.append(len(self.tokenizer.decode(output_ids[:k], skip_special_tokens=True)))
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        hit = min((p for p in (text.find(s) for s in self.stops) if p >= 0), default=-1)
        if hit >= 0:
            return self._tokens_within(hit), True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._tokens_within(len(text) - hold), False

    def _tokens_within(self, chars: int) -> int:
        k = 0
        while k + 1 < len(self.prefix_lens) and self.prefix_lens[k + 1] <= chars:
            k += 1
        return k
