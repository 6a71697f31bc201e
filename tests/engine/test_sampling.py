"""Batched sampling (python_backends/engine/sampling.py) on known logits: top-k and top-p really narrow the
choices, greedy rows stay argmax, seeded rows are reproducible whatever else shares the batch."""
from __future__ import annotations

from collections import Counter

import torch

from python_backends.engine.sampling import sample
from python_backends.engine.sequence import SamplingParams, Sequence


def _seq(**kw) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(**kw))


def _draws(logits: torch.Tensor, n: int, **kw) -> Counter:
    seqs = [_seq(**kw) for _ in range(n)]
    return Counter(sample(logits.expand(n, -1).contiguous(), seqs))


LOGITS = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]]))


def test_top_k_keeps_exactly_the_k_best():
    counts = _draws(LOGITS, 3000, temperature=1.0, top_k=3)
    assert set(counts) == {0, 1, 2}                       # all three survive, nothing else does
    without = _draws(LOGITS, 3000, temperature=1.0)
    assert len(set(without) - {0, 1, 2}) >= 3             # the same draws without top-k do leave the set


def test_top_p_keeps_the_smallest_nucleus():
    # top_p 0.7: mass before token 2 is 0.65 < 0.7, so it stays (the token that crosses top_p is kept);
    # mass before token 3 is 0.80: 3.. go. top_p 0.6: 0.65 >= 0.6, token 2 goes too.
    counts = _draws(LOGITS, 3000, temperature=1.0, top_p=0.7)
    assert set(counts) == {0, 1, 2}
    assert counts[0] > counts[1] > counts[2]              # renormalised, order kept
    assert set(_draws(LOGITS, 3000, temperature=1.0, top_p=0.6)) == {0, 1}
    assert set(_draws(LOGITS, 3000, temperature=1.0, top_p=0.3)) == {0}


def test_temperature_flattens_and_greedy_rows_stay_argmax():
    hot = _draws(LOGITS, 3000, temperature=50.0)
    assert len(hot) == 7 and max(hot.values()) < 800      # near uniform
    logits = torch.randn(6, 50)
    seqs = [_seq(), _seq(temperature=1.0), _seq(temperature=0.7, top_k=1), _seq(), _seq(temperature=2.0), _seq()]
    out = sample(logits, seqs)
    argmax = logits.argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 3, 5)] == [argmax[i] for i in (0, 2, 3, 5)]


def test_seeded_rows_reproducible_whatever_shares_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    a = _seq(temperature=1.0, seed=11)
    alone = [sample(logits[:1], [a])[0] for _ in range(5)]
    b = _seq(temperature=1.0, seed=11)
    mixed = [sample(logits, [b, _seq(temperature=1.0), _seq(), _seq(temperature=0.5, seed=3)])[0] for _ in range(5)]
    assert alone == mixed
    c = _seq(temperature=1.0, seed=12)
    assert [sample(logits[:1], [c])[0] for _ in range(5)] != alone


def test_bf16_logits_give_the_ids_of_their_fp32_cast():
    """The forward hands over bf16 logits on bf16 models (no fp32 copy of the whole vocabulary per step): greedy
    rows, ties included, and seeded sampled rows pick what they would from the same values cast to fp32."""
    torch.manual_seed(1)
    logits = torch.randn(5, 2000).to(torch.bfloat16)
    logits[0, 17] = logits[0, 1500] = logits[0].max() + 1      # a tie: the first index wins in both
    kinds = [dict(), dict(), dict(temperature=0.8, seed=5), dict(temperature=1.0, top_p=0.9, seed=6),
             dict(temperature=1.2, top_k=40, seed=7)]
    got = sample(logits, [_seq(**kw) for kw in kinds])
    want = sample(logits.float(), [_seq(**kw) for kw in kinds])
    assert got == want
    assert got[0] == 17 and got[1] == int(logits[1].float().argmax())
