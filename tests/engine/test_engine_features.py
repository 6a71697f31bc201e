"""Sampling, stops, deadlines, priorities, errors and LoRA adapters of the engine."""
from __future__ import annotations

import time

import pytest
import torch

from python_backends.engine.sequence import Priority, SamplingParams
from tests.engine.conftest import ADAPTERS_DIR, CHAT, run_to_end


def _p(tokenizer, text):
    return tokenizer.encode(CHAT.format(text)).ids


def test_seeded_sampling_is_reproducible(engine, tokenizer):
    prompt = _p(tokenizer, "Tell me a story about a dragon.")
    mk = lambda seed: engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9,  # noqa: E731
                                                                 top_k=50, seed=seed, ignore_eos=True))
    a, b, c = mk(7), mk(7), mk(8)
    r = run_to_end(engine)
    assert r[a.seq_id]["ids"] == r[b.seq_id]["ids"]
    assert r[a.seq_id]["ids"] != r[c.seq_id]["ids"]


def test_top_k_narrows_the_engine_choices(make_engine, tokenizer):
    """At temperature 5 (near uniform) every token of a top_k=2 request is one of the two best of the fp32 logits
    at its position; the same request without top-k leaves that set (the restriction is real, not a tautology)."""
    engine = make_engine()          # its own pool: the check below writes K/V into blocks of its choosing
    prompt = _p(tokenizer, "What is 2 plus 2?")
    k2 = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=5.0, top_k=2, seed=3, ignore_eos=True))
    free = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=5.0, seed=3, ignore_eos=True))
    r = run_to_end(engine)

    def outside_top2(ids: list[int]) -> int:
        runner = engine.runner
        from python_backends.engine.batch import SeqChunk
        tokens = prompt + ids
        table = list(range(1, 1 + -(-len(tokens) // 16)))
        batch = runner.prepare([SeqChunk(tokens, 0, table, True)])
        batch.logits_rows = torch.arange(len(prompt) - 1, len(tokens) - 1)
        top2 = runner.forward(batch).topk(2, dim=-1).indices
        return sum(t not in row for t, row in zip(ids, top2.tolist()))
    assert outside_top2(r[k2.seq_id]["ids"]) == 0
    assert outside_top2(r[free.seq_id]["ids"]) >= 3


def test_stop_word_is_not_emitted(engine, tokenizer):
    prompt = _p(tokenizer, "What is the capital of France? Tell me about it.")
    free = engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    text = tokenizer.decode(run_to_end(engine)[free.seq_id]["ids"])
    assert "Paris" in text
    stopped = engine.add_request(prompt, SamplingParams(max_tokens=24, stop=["Paris"], ignore_eos=True))
    r = run_to_end(engine)[stopped.seq_id]
    out = tokenizer.decode(r["ids"])
    assert r["finish"] == "stop"
    assert "Paris" not in out
    assert text.startswith(out) and text[:text.index("Paris")].startswith(out.rstrip())


def test_max_tokens_and_eos(engine, tokenizer):
    prompt = _p(tokenizer, "Say hi.")
    a = engine.add_request(prompt, SamplingParams(max_tokens=3))
    b = engine.add_request(prompt, SamplingParams(max_tokens=400))
    r = run_to_end(engine)
    assert r[a.seq_id]["finish"] == "length" and len(r[a.seq_id]["ids"]) == 3
    assert r[b.seq_id]["finish"] == "stop" and 2 not in r[b.seq_id]["ids"]    # stopped on EOS, not emitted


def test_deadline_and_errors(engine, tokenizer):
    prompt = _p(tokenizer, "Hello")
    past = engine.add_request(prompt, SamplingParams(max_tokens=8), deadline_ms=int(time.time() * 1000) - 1)
    bad = engine.add_request(prompt, SamplingParams(max_tokens=8), lora_name="no-such-adapter")
    r = run_to_end(engine)
    assert r[past.seq_id]["finish"] == "deadline"
    assert r[bad.seq_id]["finish"] == "error"


def test_admission_order_priority_then_deadline(make_engine, tokenizer):
    eng = make_engine(max_num_seqs=1)
    prompt = _p(tokenizer, "Hi")
    now = int(time.time() * 1000)
    batch = eng.add_request(prompt, SamplingParams(max_tokens=2), priority=Priority.BATCH)
    std_late = eng.add_request(prompt, SamplingParams(max_tokens=2), priority=Priority.STANDARD, deadline_ms=now + 90_000)
    std_soon = eng.add_request(prompt, SamplingParams(max_tokens=2), priority=Priority.STANDARD, deadline_ms=now + 60_000)
    inter = eng.add_request(prompt, SamplingParams(max_tokens=2), priority=Priority.INTERACTIVE)
    order: list[int] = []
    for _ in range(100):
        if not eng.has_work():
            break
        order += [o.seq.seq_id for o in eng.step() if o.finished]
    assert order == [inter.seq_id, std_soon.seq_id, std_late.seq_id, batch.seq_id]


def test_interactive_preempts_batch(make_engine):
    # 30 usable blocks: two 200-token batch prompts (13 blocks each + estimate) fit, the third waits
    eng = make_engine(num_kv_blocks=31, output_estimate=16)
    batch = [eng.add_request(list(range(300 + 1000 * i, 500 + 1000 * i)), SamplingParams(max_tokens=30, ignore_eos=True),
                             priority=Priority.BATCH) for i in range(3)]
    for _ in range(3):
        eng.step()
    assert len(eng.scheduler.running) == 2
    inter = eng.add_request(list(range(6000, 6200)), SamplingParams(max_tokens=4, ignore_eos=True),
                            priority=Priority.INTERACTIVE)
    eng.step()
    assert inter in eng.scheduler.running
    assert eng.scheduler.num_preemptions >= 1
    r = run_to_end(eng)
    assert all(r[s.seq_id]["finish"] == "length" for s in batch + [inter])


@pytest.fixture(scope="module")
def adapters_present():
    for name in ("french", "terse-json"):
        if not (ADAPTERS_DIR / name / "adapter_model.safetensors").exists():
            pytest.fail(f"adapter {name} missing; run python -m python_backends.engine.lora_train")


def test_adapters_change_output_and_mix_in_one_batch(engine, tokenizer, adapters_present):
    prompts = {name: _p(tokenizer, "What is the capital of Italy?") for name in ("", "french", "terse-json")}
    solo = {}
    for name, prompt in prompts.items():
        s = engine.add_request(prompt, SamplingParams(max_tokens=12), lora_name=name)
        solo[name] = run_to_end(engine)[s.seq_id]["ids"]
    assert solo["french"] != solo[""] and solo["terse-json"] != solo[""] and solo["french"] != solo["terse-json"]
    assert "Rome" in tokenizer.decode(solo["terse-json"]) or "{" in tokenizer.decode(solo["terse-json"])
    # one batch: base, french, json, french, base - each row gets its own adapter's output
    names = ["", "french", "terse-json", "french", ""]
    seqs = [engine.add_request(prompts[n], SamplingParams(max_tokens=12), lora_name=n) for n in names]
    mixed_batches: list[int] = []
    r = run_to_end(engine, on_step=lambda e: mixed_batches.append(
        len({s.lora_name for s in e.scheduler.running})))
    assert max(mixed_batches) == 3
    for n, s in zip(names, seqs):
        assert r[s.seq_id]["ids"] == solo[n], n
    assert set(engine.lora.loaded()) >= {"french", "terse-json"}


def test_adapter_cache_lru_with_many_adapters(make_engine, tmp_path, tokenizer):
    """More adapters than slots: loaded on first use, least recently used evicted, outputs unchanged by churn."""
    from bench.engine.make_adapters import make

    make(tmp_path, 3)
    eng = make_engine(adapters_dir=str(tmp_path), max_loras=2)
    prompt = _p(tokenizer, "Hi")
    first = {}
    for name in ("random-000", "random-001", "random-002", "random-000"):
        s = eng.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), lora_name=name)
        ids = run_to_end(eng)[s.seq_id]["ids"]
        assert first.setdefault(name, ids) == ids
        assert len(eng.lora.loaded()) <= 2
    assert eng.lora.loads == 4          # random-000 was evicted by random-002, then loaded again
    assert eng.lora.loaded() == ["random-002", "random-000"]
