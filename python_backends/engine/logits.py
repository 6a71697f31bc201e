"""Per-request logit processing before sampling (OpenAI's penalties, logit_bias, min_tokens) and the
bounds of every sampling field, checked when a request arrives.

Applied on the logits the model runner returns, in fp32, only to the rows of requests that ask for it
(a batch of plain requests pays nothing). The formulas are the reference ones:
- presence/frequency (OpenAI): logit[j] -= frequency * count[j] + presence * (count[j] > 0), count over the
  output tokens so far;
- repetition (transformers' RepetitionPenaltyLogitsProcessor): every token of prompt + output, logit / r
  when positive, logit * r when not;
- logit_bias: added to the logit of each listed token id;
- min_tokens: EOS ids and stop_token_ids get -inf until min_tokens tokens were generated.
"""
from __future__ import annotations

import math

import torch

from python_backends.engine.sequence import SamplingParams, Sequence

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300        # entries (OpenAI's own limit)
MAX_STOP_TOKEN_IDS = 16


def check_params(p: SamplingParams, vocab: int) -> str:
    """'' when every sampling field is within its bounds, else the problem (field, value, what is allowed)."""
    def bad(x: float, lo: float, hi: float) -> bool:
        return not (math.isfinite(x) and lo <= x <= hi)
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs: {p.top_logprobs} is out of range; allowed: 0..{MAX_TOP_LOGPROBS}"
    for name in ("presence_penalty", "frequency_penalty"):
        if bad(getattr(p, name), -2.0, 2.0):
            return f"{name}: {getattr(p, name)} is out of range; allowed: -2..2"
    if bad(p.repetition_penalty, 1e-3, 10.0):
        return f"repetition_penalty: {p.repetition_penalty} is out of range; allowed: (0, 10], 1 = off"
    if bad(p.min_p, 0.0, 1.0):
        return f"min_p: {p.min_p} is out of range; allowed: 0..1"
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
    for tok, bias in p.logit_bias.items():
        if not 0 <= tok < vocab:
            return f"logit_bias: token id {tok} is out of range; allowed: 0..{vocab - 1}"
        if bad(bias, -100.0, 100.0):
            return f"logit_bias: bias {bias} of token {tok} is out of range; allowed: -100..100"
    if not 0 <= p.min_tokens <= max(0, p.max_tokens):
        return f"min_tokens: {p.min_tokens} must be between 0 and max_tokens ({p.max_tokens})"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not 0 <= t < vocab for t in p.stop_token_ids):
        return f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids in 0..{vocab - 1}"
    return ""


def shape_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int], ahead: int = 0) -> torch.Tensor:
    """logits with each requesting row's penalties, bias and min_tokens applied (fp32 copy), or logits
    itself when no row asks. ahead: output tokens sampled but not yet appended (async decode)."""
    rows = [r for r, s in enumerate(seqs) if s.params.shapes_logits]
    if not rows:
        return logits
    x = logits.float().clone()
    dev, vocab = x.device, x.shape[-1]
    for r in rows:
        seq, p = seqs[r], seqs[r].params
        row = x[r]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), device=dev)
            vals = row.index_select(0, seen)
            row.index_copy_(0, seen, torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty))
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output:
            counts = torch.bincount(torch.tensor(seq.output_ids, device=dev), minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=dev, dtype=row.dtype))
        if seq.num_output + ahead < p.min_tokens:
            banned = sorted(set(eos_ids) | set(p.stop_token_ids))
            if banned:
                row.index_fill_(0, torch.tensor(banned, device=dev), float("-inf"))
    return x
