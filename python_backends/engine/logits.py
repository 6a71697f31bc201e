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
The bounds of every field: common.sampling_fields.
"""
from __future__ import annotations

import torch

from python_backends.engine.sequence import Sequence


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
