"""The benchmark workloads, identical for every system. Poisson: arrivals, prompts of 100-1,000 token ids
(half of them starting with one shared 300-token system prompt), outputs of 16-256 tokens (EOS ignored, so
every system does the same work). Burst: chat-sized prompts all sent at once with a fixed output length."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Request:
    idx: int
    arrival_s: float           # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int
    shared_prefix: bool


def make_workload(n: int, rate_per_s: float, seed: int = 0, system_len: int = 300,
                  prompt_range: tuple[int, int] = (100, 1000), output_range: tuple[int, int] = (16, 256),
                  vocab: tuple[int, int] = (200, 40000)) -> list[Request]:
    rng = random.Random(seed)
    system = [rng.randrange(*vocab) for _ in range(system_len)]
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        total = rng.randrange(prompt_range[0], prompt_range[1] + 1)
        shared = i % 2 == 0
        if shared:
            total = max(total, system_len + 50)
            prompt = system + [rng.randrange(*vocab) for _ in range(total - system_len)]
        else:
            prompt = [rng.randrange(*vocab) for _ in range(total)]
        out.append(Request(i, t, prompt, rng.randrange(output_range[0], output_range[1] + 1), shared))
    return out


def make_burst(n: int, seed: int = 0, prompt_range: tuple[int, int] = (20, 60), output_tokens: int = 128,
               vocab: tuple[int, int] = (200, 40000)) -> list[Request]:
    """n chat-sized prompts all arriving at t=0, `output_tokens` each: the uniform burst (everyone starts
    together, so static batching is at its best and continuous batching has nothing to fill in)."""
    rng = random.Random(seed + 1)
    return [Request(i, 0.0, [rng.randrange(*vocab) for _ in range(rng.randrange(prompt_range[0], prompt_range[1] + 1))],
                    output_tokens, False) for i in range(n)]
