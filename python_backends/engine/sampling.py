"""Token sampling for one step: greedy rows in one argmax, sampled rows with their own seeded generator.

Temperature, top-k and top-p (nucleus) follow the usual order: scale by temperature, keep the top-k logits,
then the smallest set of tokens whose probability mass reaches top_p. A per-sequence torch.Generator seeded
from the request's seed makes sampling reproducible: same seed, same prompt, same output.
"""
from __future__ import annotations

import torch

from python_backends.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: fp32 [len(seqs), vocab]; returns one token id per sequence."""
    out = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        x = logits[row] / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if 0.0 < p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # drop tokens once the mass *before* them already reaches top_p (the first token always stays)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
        probs = torch.softmax(x, dim=-1)
        out[row] = int(torch.multinomial(probs, 1, generator=seq.step_generator()).item())
    return out
