"""Async decode (the next decode step launched before the previous step's ids reach the host) must not change
what the engine returns: same ids, finish reasons and usage as the synchronous engine, for greedy and seeded
requests, mixed max_tokens, stop strings and EOS, with every block back in the pool at the end."""
from __future__ import annotations

import random

from python_backends.engine.sequence import SamplingParams
from tests.engine.conftest import random_prompt, run_to_end


def _run(eng, prompts, params):
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    res = run_to_end(eng)
    return [(res[s.seq_id]["ids"], res[s.seq_id]["finish"], res[s.seq_id]["usage"]) for s in seqs]


def _params(rng: random.Random, n: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.8, top_p=0.9, seed=i))
        elif i % 3 == 1:
            out.append(SamplingParams(max_tokens=rng.randrange(1, 24), stop=["the", "."]))
        else:
            out.append(SamplingParams(max_tokens=rng.randrange(1, 24)))
    return out


def test_async_decode_returns_what_the_sync_engine_returns(make_engine):
    rng = random.Random(7)
    prompts = [random_prompt(rng, rng.randrange(3, 40)) for _ in range(10)]
    sync_eng = make_engine(async_decode=0)
    async_eng = make_engine(async_decode=1)
    want = _run(sync_eng, prompts, _params(random.Random(1), len(prompts)))
    got = _run(async_eng, prompts, _params(random.Random(1), len(prompts)))
    assert got == want
    assert async_eng.lookahead_steps > 0 and sync_eng.lookahead_steps == 0
    assert async_eng.kv.pool.num_used == 0


def test_async_decode_with_abort_and_small_pool(make_engine):
    """An abort while a step is in flight drops its row; a tight pool falls back to the scheduler (preemption)."""
    rng = random.Random(3)
    prompts = [random_prompt(rng, 30) for _ in range(6)]
    ref = _run(make_engine(num_kv_blocks=40, output_estimate=1, async_decode=0), prompts,
               [SamplingParams(max_tokens=40) for _ in prompts])
    eng = make_engine(num_kv_blocks=40, output_estimate=1, async_decode=1)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    victim = eng.add_request(random_prompt(rng, 10), SamplingParams(max_tokens=40))
    aborted = False

    def on_step(e):
        nonlocal aborted
        if not aborted and victim.num_output >= 3:
            e.abort(victim)
            aborted = True
    res = run_to_end(eng, on_step=on_step)
    assert aborted and res[victim.seq_id]["finish"] == "cancelled"
    assert [(res[s.seq_id]["ids"], res[s.seq_id]["finish"]) for s in seqs] == [(i, f) for i, f, _ in ref]
    assert eng.kv.pool.num_used == 0
