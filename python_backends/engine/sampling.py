"""Token sampling for one step, batched on the logits' device with one host sync.

Every row is handled in the same few tensor ops: temperature scaling, top-k and top-p (nucleus) masks on the
logits sorted once per step, then the exponential race (argmax of p / q with q ~ Exp(1), equivalent to drawing
from p) - the way vLLM samples without a per-row multinomial. Greedy rows take the argmax. Rows with a request
seed draw their q from their own torch.Generator on the device (created on first use, kept on the sequence, so
the same seed and prompt give the same output whatever else shares the batch, also after preemption); the
other rows share one draw. The only host sync is the final `.tolist()` (none in `sample_on_device`).

min_p drops tokens whose probability is below min_p x the most likely one's (after top-k/top-p). Rows that
ask for logprobs get them from the distribution their token was drawn from: greedy rows the log-softmax of
their (processed) logits, random rows the log of the final probabilities (temperature, top-k, top-p,
min_p applied; dropped tokens are -inf), with the `top_logprobs` most likely tokens of it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from python_backends.engine.sequence import Sequence


_M64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for sampling step `step` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _generator(seq: Sequence, device: torch.device, ahead: int = 0) -> torch.Generator:
    """The generator for a seeded sequence's next token. Seeded per step from (seed, seed_offset + output
    tokens so far), so the draw for output token k does not depend on the draws this process made before:
    a stream the router resumes elsewhere (with seed_offset = tokens already generated) continues the same
    random stream."""
    if seq.generator is None or seq.generator.device != device:
        seq.generator = torch.Generator(device=device)
    seq.generator.manual_seed(step_seed(seq.params.seed, seq.params.seed_offset + seq.num_output + ahead))
    return seq.generator


@dataclass
class StepLogprobs:
    """Log probabilities of one step's sampled tokens, still on the device (read at resolve)."""
    rows: list[int]              # rows of the step that asked for them
    chosen: torch.Tensor         # [len(rows)] the sampled token's logprob
    top_ids: torch.Tensor        # [len(rows), k] the k most likely tokens (k = the largest top_logprobs asked)
    top_lps: torch.Tensor        # [len(rows), k]

    def per_row(self, seqs: list[Sequence]) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """row -> (logprob, [(id, logprob) x that row's top_logprobs]) (one host sync)."""
        chosen, ids, lps = self.chosen.tolist(), self.top_ids.tolist(), self.top_lps.tolist()
        out = {}
        for i, r in enumerate(self.rows):
            k = seqs[r].params.top_logprobs
            out[r] = (chosen[i], list(zip(ids[i][:k], lps[i][:k])))
        return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [len(seqs), vocab] (fp32, or the model's compute dtype) on any device; one token id per sequence."""
    return sample_on_device(logits, seqs).tolist()


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0,
                     argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """As `sample`, but the ids stay on the logits' device (int64 [len(seqs)]); no host sync. ahead: output
    tokens each sequence has sampled that are not in its token list yet (async decode's step in flight).
    argmax: each row's first maximum (the CPU kernels' argmax_rows: 0.1 vs 0.6 ms for 32 x 49,152 bf16)."""
    return sample_with_logprobs(logits, seqs, ahead, argmax)[0]


def sample_with_logprobs(logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0,
                         argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, StepLogprobs | None]:
    """As `sample_on_device`, plus the logprobs of the rows that ask for them (None when none does)."""
    # max's indices: the first maximum of each row, as argmax's, at 0.4 vs 1.0 ms for 32 x 49,152 on the CPU
    greedy_ids = argmax(logits) if argmax is not None else logits.max(dim=-1).indices
    random_rows = [r for r, s in enumerate(seqs) if not s.params.greedy]
    lp_rows = [r for r, s in enumerate(seqs) if s.params.wants_logprobs]
    if not random_rows:
        return greedy_ids, _logprobs(logits, seqs, lp_rows, greedy_ids, {}, None)
    dev = logits.device
    sub = [seqs[r] for r in random_rows]
    rows = torch.tensor(random_rows, device=dev)
    x = logits.index_select(0, rows).float()   # the forward's logits may be bf16: sample in fp32
    n, vocab = x.shape
    params = torch.tensor([[s.params.temperature, s.params.top_k if 0 < s.params.top_k < vocab else vocab,
                            s.params.top_p if 0.0 < s.params.top_p < 1.0 else 1.0, s.params.min_p] for s in sub],
                          dtype=torch.float32).to(dev, non_blocking=True)
    x = x / params[:, 0:1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = rank >= params[:, 1:2]                                    # top-k
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # top-p: drop a token once the mass *before* it already reaches top_p (the first token always stays)
    drop |= (probs.cumsum(-1) - probs) >= params[:, 2:3]
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    if any(s.params.min_p > 0 for s in sub):   # min_p: relative to the most likely token (sorted first)
        drop |= probs < probs[:, :1] * params[:, 3:4]
        probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    q = torch.empty_like(probs).exponential_()
    for i, s in enumerate(sub):
        if s.params.seed is not None:
            q[i].exponential_(generator=_generator(s, dev, ahead))
    choice = (probs / q).argmax(dim=-1, keepdim=True)
    picked = order.gather(1, choice).squeeze(1)
    ids = greedy_ids.index_copy(0, rows, picked)
    drawn = {r: i for i, r in enumerate(random_rows)}
    return ids, _logprobs(logits, seqs, lp_rows, ids, drawn, (probs, order))


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], lp_rows: list[int], ids: torch.Tensor,
              drawn: dict[int, int], random: tuple[torch.Tensor, torch.Tensor] | None) -> StepLogprobs | None:
    """Log-distributions the rows' tokens came from: greedy rows log_softmax(logits), random rows
    log(final probs) scattered back to vocabulary order."""
    if not lp_rows:
        return None
    dists = []
    for r in lp_rows:
        if r in drawn:
            probs, order = random
            i = drawn[r]
            dists.append(torch.zeros_like(probs[i]).scatter_(0, order[i], probs[i]).log())
        else:
            dists.append(torch.log_softmax(logits[r].float(), dim=-1))
    dist = torch.stack(dists)
    rows_t = torch.tensor(lp_rows, device=dist.device)
    chosen = dist.gather(1, ids.index_select(0, rows_t).unsqueeze(1)).squeeze(1)
    k = max(max(seqs[r].params.top_logprobs for r in lp_rows), 1)
    top = dist.topk(k, dim=-1)   # sorted, most likely first
    return StepLogprobs(lp_rows, chosen, top.indices, top.values)
