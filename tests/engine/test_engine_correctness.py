"""The engine's outputs are right: greedy ids equal transformers' greedy generate (fp32), alone and inside
mixed continuous batches; prefix-cache hits and preempted-and-resumed sequences give the same ids; every
block is free again after a mixed run with cancels; the KV pool holds no more than the resident tokens need."""
from __future__ import annotations

import random

from python_backends.engine.sequence import SamplingParams
from tests.engine.conftest import CHAT, random_prompt, run_to_end

N_TOKENS = 32


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(CHAT.format(text)).ids


def test_greedy_matches_transformers_alone(engine, tokenizer, hf_greedy):
    prompt = _prompt(tokenizer, "What is the capital of France? Tell me about it.")
    seq = engine.add_request(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))
    results = run_to_end(engine)
    assert results[seq.seq_id]["ids"] == hf_greedy(prompt, N_TOKENS)
    assert results[seq.seq_id]["finish"] == "length"
    assert results[seq.seq_id]["usage"] == (len(prompt), 0, N_TOKENS)


def test_greedy_matches_transformers_in_mixed_batches(make_engine, tokenizer, hf_greedy):
    """The checked prompt shares its steps with 15 others of other lengths, decodes and prefill chunks mixed."""
    eng = make_engine(max_num_batched_tokens=64)     # small budget: long prompts really are chunked
    rng = random.Random(1)
    prompt = _prompt(tokenizer, "Write a short poem about the sea and the wind.")
    others = [eng.add_request(random_prompt(rng, rng.randrange(5, 160)),
                              SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True)) for _ in range(8)]
    seq = eng.add_request(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True))
    others += [eng.add_request(random_prompt(rng, rng.randrange(5, 160)),
                               SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True)) for _ in range(7)]
    batch_sizes: list[int] = []
    results = run_to_end(eng, on_step=lambda e: batch_sizes.append(len(e.scheduler.running)))
    assert results[seq.seq_id]["ids"] == hf_greedy(prompt, N_TOKENS)
    assert max(batch_sizes) >= 8, "the sequences should have run together"
    assert all(results[o.seq_id]["finish"] == "length" for o in others)


def test_prefix_cache_hit_gives_same_ids(make_engine, tokenizer):
    eng = make_engine()
    system = "You are a helpful assistant who knows geography, history and cooking. " * 4
    a = tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n" + CHAT.format("Name three rivers.")).ids
    miss = eng.add_request(a, SamplingParams(max_tokens=24, ignore_eos=True))
    r1 = run_to_end(eng)
    hit = eng.add_request(a, SamplingParams(max_tokens=24, ignore_eos=True))
    r2 = run_to_end(eng)
    assert r1[miss.seq_id]["usage"][1] == 0
    cached = r2[hit.seq_id]["usage"][1]
    assert cached >= (len(a) - 1) // 16 * 16 - 16 and cached > 0
    assert r2[hit.seq_id]["ids"] == r1[miss.seq_id]["ids"]
    assert eng.kv.hit_rate() > 0.4


def test_preempted_and_resumed_sequences_give_same_ids(make_engine):
    rng = random.Random(2)
    prompts = [random_prompt(rng, rng.randrange(100, 140)) for _ in range(6)]
    ref_engine = make_engine()
    refs = [ref_engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True)) for p in prompts]
    ref = run_to_end(ref_engine)
    # 52 usable blocks hold 832 tokens: the six prompts fit (~720 tokens) but their outputs (6 x 32) do not, so
    # decodes run out of blocks and the least important sequences are preempted and recomputed later
    small = make_engine(num_kv_blocks=53, output_estimate=1)
    seqs = [small.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True), priority=i % 3)
            for i, p in enumerate(prompts)]
    out = run_to_end(small)
    assert small.scheduler.num_preemptions > 0
    assert sum(s.preemptions for s in seqs) > 0
    for s, r in zip(seqs, refs):
        assert out[s.seq_id]["ids"] == ref[r.seq_id]["ids"]
    assert small.kv.pool.num_used == 0


def test_all_blocks_free_after_mixed_run_with_cancels(make_engine):
    eng = make_engine(max_num_batched_tokens=96)
    rng = random.Random(3)
    seqs = [eng.add_request(random_prompt(rng, rng.randrange(10, 200)),
                            SamplingParams(max_tokens=rng.randrange(4, 30)), priority=rng.randrange(3))
            for _ in range(12)]
    results: dict = {}
    for step in range(10_000):
        if not eng.has_work():
            break
        if step == 3:
            eng.abort(seqs[0])            # cancelled while running
            eng.abort(seqs[-1])           # cancelled while (probably) still waiting
        if step == 8:
            eng.abort(seqs[5])
        for out in eng.step():
            if out.finished:
                results[out.seq.seq_id] = out.finish_reason
        if step == 3:
            assert results.get(seqs[0].seq_id) == "cancelled"
    assert results[seqs[0].seq_id] == results[seqs[-1].seq_id] == "cancelled"
    assert len(results) == len(seqs)
    pool = eng.kv.pool
    assert pool.num_used == 0 and pool.num_free == pool.num_usable
    assert all(rc == 0 for rc in pool.ref_count)


def test_kv_memory_tracks_resident_tokens(make_engine):
    """Blocks in use never exceed 1.1x what the resident tokens need (prompts of bench-like lengths)."""
    eng = make_engine(max_num_batched_tokens=256)
    rng = random.Random(4)
    for _ in range(8):
        eng.add_request(random_prompt(rng, rng.randrange(150, 400)), SamplingParams(max_tokens=8, ignore_eos=True))
    ratios: list[float] = []
    run_to_end(eng, on_step=lambda e: ratios.append(e.kv_overhead()))
    assert max(ratios) <= 1.1, max(ratios)


def test_decode_rows_grouped_by_length_give_the_ids_of_one_group(make_engine, tokenizer, hf_greedy, monkeypatch):
    """Without the fused kernels (whose decode attention reads each row's own blocks, unpadded): short and long
    contexts in one step are attended in separate length groups (less padding) and the rows put back in order. Every sequence's ids equal those of the same run attended as one group
    (the same steps, each row padded to the longest), and the chat prompt's equal transformers'."""
    from python_backends.engine import cpu_attention
    real = cpu_attention.group_by_length
    rng = random.Random(2)
    short = _prompt(tokenizer, "Write a short poem about the sea and the wind.")
    prompts = [short, random_prompt(rng, 12), random_prompt(rng, 700), random_prompt(rng, 600),
               random_prompt(rng, 20), random_prompt(rng, 640)]

    def run(group_by_length) -> tuple[list[list[int]], int]:
        seen: list[int] = []
        monkeypatch.setattr(cpu_attention, "group_by_length",
                            lambda blocks, **kw: (g := group_by_length(blocks, **kw), seen.append(len(g)))[0])
        eng = make_engine(max_num_batched_tokens=1024, cpu_kernels="off")
        seqs = [eng.add_request(p, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)) for p in prompts]
        results = run_to_end(eng)
        return [results[s.seq_id]["ids"] for s in seqs], max(seen)

    grouped, most = run(real)
    assert most >= 2, "the short and long decode rows should have been attended in separate groups"
    one_group, _ = run(lambda blocks, **kw: [list(range(len(blocks)))])
    assert grouped == one_group
    assert grouped[0] == hf_greedy(short, N_TOKENS)
