"""Sampling fields in the engine's batched step: logprobs (against transformers' log-softmax of the same
prefix, fp32), penalties and logit_bias (against the reference formulas and transformers' own processor),
min_p, min_tokens, stop_token_ids, and the bounds every field is checked against."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from common.sampling_fields import MAX_TOP_LOGPROBS, check_params
from python_backends.engine.logits import shape_logits
from python_backends.engine.sampling import sample, sample_with_logprobs
from python_backends.engine.sequence import SamplingParams, Sequence
from tests.engine.conftest import CHAT, run_to_end

# fp32 engine vs fp32 transformers: same weights, different kernels and summation order
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_greedy_logprobs_equal_transformers_log_softmax(engine, tokenizer, hf_model):
    prompt = tokenizer.encode(CHAT.format("Name three colours.")).ids
    seq = engine.add_request(prompt, SamplingParams(max_tokens=12, logprobs=True, top_logprobs=5))
    lps = []
    for _ in range(500):
        if not engine.has_work():
            break
        lps += [lp for out in engine.step() if out.seq is seq for lp in (out.logprobs or [])]
    out_ids = seq.output_ids
    assert len(lps) == len(out_ids) > 0
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + out_ids])).logits[0].float(), dim=-1)
    for i, (tok, (lp, top)) in enumerate(zip(out_ids, lps)):
        expected = ref[len(prompt) - 1 + i]
        assert lp == pytest.approx(expected[tok].item(), abs=LOGPROB_ATOL)
        assert len(top) == 5 and top[0][0] == tok, "greedy: the chosen token is the most likely"
        assert [p for _, p in top] == sorted((p for _, p in top), reverse=True) and all(p <= 0 for _, p in top)
        ref_top = expected.topk(5)
        assert [t for t, _ in top][:3] == ref_top.indices.tolist()[:3]
        assert [p for _, p in top] == pytest.approx(ref_top.values.tolist(), abs=LOGPROB_ATOL)


def test_sampled_logprobs_come_from_the_drawn_distribution():
    logits = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]]))
    seqs = [Sequence([1], SamplingParams(temperature=1.0, top_k=2, logprobs=True, top_logprobs=3, seed=7))]
    ids, lps = sample_with_logprobs(logits, seqs)
    (chosen, top), = lps.per_row(seqs).values()
    # top-k 2 renormalised: 0.4/0.65, 0.25/0.65; the rest cannot be drawn (-inf)
    assert ids.item() in (0, 1) and chosen == pytest.approx(torch.tensor([0.4, 0.25])[ids.item()].div(0.65).log().item())
    assert [t for t, _ in top][:2] == [0, 1] and top[2][1] == float("-inf")


def test_min_p_keeps_tokens_near_the_best():
    logits = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02]]))
    seqs = [Sequence([1], SamplingParams(temperature=1.0, min_p=0.5)) for _ in range(2000)]
    assert set(sample(logits.expand(2000, -1).contiguous(), seqs)) == {0, 1}   # 0.25 >= 0.5 * 0.4 > 0.15


def test_penalties_and_bias_follow_the_reference_formulas():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seqs = [Sequence([4, 5, 6], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)),
            Sequence([4, 5, 6], SamplingParams(repetition_penalty=1.3)),
            Sequence([4, 5, 6], SamplingParams(logit_bias={9: 5.0, 10: -100.0}, min_tokens=4))]
    for s in seqs:
        s.token_ids += [7, 7, 8]
    out = shape_logits(logits, seqs, eos_ids={2})
    counts = torch.bincount(torch.tensor([7, 7, 8]), minlength=50).float()
    assert torch.allclose(out[0], logits[0] - 0.25 * counts - 0.5 * (counts > 0).float())   # OpenAI's formula
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[4, 5, 6, 7, 7, 8]]), logits[1:2].clone())
    assert torch.allclose(out[1], ref[0])
    assert out[2][9].item() == pytest.approx(logits[2][9].item() + 5) and out[2][2] == float("-inf")
    assert out[2][10].item() == pytest.approx(logits[2][10].item() - 100)
    assert shape_logits(logits, [Sequence([1], SamplingParams())] * 3, {2}) is logits, "no copy when nobody asks"


def test_repetition_penalty_equals_transformers_generate(make_engine, smollm2_dir, hf_model, tokenizer):
    prompt = tokenizer.encode(CHAT.format("Repeat the word cat ten times.")).ids
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    engine = make_engine(num_kv_blocks=256)
    plain = engine.add_request(prompt, SamplingParams(max_tokens=16))
    penalised = engine.add_request(prompt, SamplingParams(max_tokens=16, repetition_penalty=1.5))
    results = run_to_end(engine)
    eos = engine.runner.eos_ids
    assert results[penalised.seq_id]["ids"] == [t for t in ref if t not in eos][:len(results[penalised.seq_id]["ids"])]
    assert results[penalised.seq_id]["ids"] != results[plain.seq_id]["ids"], "the penalty changes the output"


def test_stop_token_ids_and_min_tokens(engine, tokenizer):
    prompt = tokenizer.encode(CHAT.format("Count from one to ten in words.")).ids
    free = engine.add_request(prompt, SamplingParams(max_tokens=12))
    results = run_to_end(engine)
    ids = results[free.seq_id]["ids"]
    stopper = engine.add_request(prompt, SamplingParams(max_tokens=12, stop_token_ids=[ids[2]]))
    results = run_to_end(engine)
    assert results[stopper.seq_id]["ids"] == ids[:ids.index(ids[2])] and results[stopper.seq_id]["finish"] == "stop"
    late = engine.add_request(prompt, SamplingParams(max_tokens=12, stop_token_ids=[ids[2]], min_tokens=5))
    results = run_to_end(engine)
    assert len(results[late.seq_id]["ids"]) >= 5


@pytest.mark.parametrize("field,value,needle", [
    ("top_logprobs", MAX_TOP_LOGPROBS + 1, "allowed: 0..20"), ("presence_penalty", 3.0, "allowed: -2..2"),
    ("frequency_penalty", float("nan"), "allowed: -2..2"), ("repetition_penalty", 0.0, "allowed: (0, 10]"),
    ("min_p", 1.5, "allowed: 0..1"), ("logit_bias", {10**6: 1.0}, "token id 1000000 is out of range"),
    ("logit_bias", {5: 101.0}, "allowed: -100..100"), ("min_tokens", 100, "between 0 and max_tokens"),
    ("stop_token_ids", [-1], "stop_token_ids"),
])
def test_bounds_refuse_with_the_field(engine, field, value, needle):
    params = SamplingParams(max_tokens=8, **{field: value})
    assert check_params(params, engine.runner.vocab).startswith(field)
    assert needle in check_params(params, engine.runner.vocab)
    seq = engine.add_request([1, 2, 3], params)
    assert seq.finish_reason.value == "error" and seq.error.startswith(field)
    engine.take_pending()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
    "required": ["name", "age", "colour", "tags"], "additionalProperties": False}


def _valid(text: str) -> dict:
    import json
    obj = json.loads(text)
    assert set(obj) == set(SCHEMA["properties"]) and isinstance(obj["age"], int) and obj["colour"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    return obj


def test_json_schema_output_is_valid_and_survives_a_resume(engine, tokenizer):
    """Constrained rows share the batch with a free one; a stream cut after 7 tokens and resumed as a new
    request (prompt + emitted ids, seed_offset = 7: a fresh matcher replays them) still ends as valid JSON."""
    prompt = tokenizer.encode(CHAT.format("Describe a person as JSON.")).ids
    spec = {"type": "json_schema", "schema": SCHEMA}
    guided = engine.add_request(prompt, SamplingParams(max_tokens=80, guided=spec))
    free = engine.add_request(prompt, SamplingParams(max_tokens=8))
    results = run_to_end(engine)
    assert results[guided.seq_id]["finish"] == "stop" and results[free.seq_id]["ids"]
    whole = results[guided.seq_id]["ids"]
    _valid(tokenizer.decode(whole))
    compiles = engine.grammars().compiles
    engine.grammars().compile(dict(spec))
    assert engine.grammars().compiles == compiles, "compiled once per schema"
    other = engine
    cut = whole[:7]
    resumed = other.add_request(prompt + cut, SamplingParams(max_tokens=80 - 7, guided=spec, seed_offset=7))
    rest = run_to_end(other)[resumed.seq_id]["ids"]
    assert _valid(tokenizer.decode(cut + rest)) == _valid(tokenizer.decode(whole)), "greedy: the same value"
    bad = other.add_request(prompt + [tokenizer.token_to_id("Hello")], SamplingParams(guided=spec, seed_offset=1))
    assert bad.finish_reason.value == "error" and "does not follow the grammar" in bad.error
    other.take_pending()
    broken = other.add_request(prompt, SamplingParams(guided={"type": "regex", "pattern": "([a-z"}))
    assert broken.finish_reason.value == "error" and broken.error.startswith("response_format: cannot be compiled")
    other.take_pending()


def test_costly_schemas_are_refused_before_any_compile():
    """Distinct length bounds are what makes xgrammar slow (~1 s each here): over the bound, refused by name."""
    from common.sampling_fields import MAX_LENGTH_BOUNDS, MAX_QUANTIFIERS, spec_problem

    def schema(n: int) -> dict:
        props = {f"f{i}": {"type": "string", "maxLength": 100 + i} for i in range(n)}
        return {"type": "json_schema", "schema": {"type": "object", "properties": props, "required": list(props)}}
    assert spec_problem(schema(MAX_LENGTH_BOUNDS)) == ""
    assert "distinct string length bounds" in spec_problem(schema(MAX_LENGTH_BOUNDS + 1))
    pattern = "".join(f"a{{1,{n}}}" for n in range(2, MAX_QUANTIFIERS + 3))
    assert "repetition bounds" in spec_problem({"type": "regex", "pattern": pattern})
    params = SamplingParams(max_tokens=8, guided=schema(MAX_LENGTH_BOUNDS + 1))
    assert check_params(params, 49152).startswith("response_format:")


def test_compile_later_keeps_the_callers_thread_free_and_bounds_waiting_compiles(engine):
    """The Triton shim's path: compiles run on the replica's one compile thread; a cached grammar answers at
    once; beyond MAX_PENDING_COMPILES waiting, a request is refused as busy (never queued without bound)."""
    import threading

    cache = engine.grammars()
    gate, results, arrived = threading.Event(), {}, threading.Semaphore(0)

    def done(name):
        def record(grammar, problem):
            results[name] = (grammar, problem)
            arrived.release()
        return record
    cache._worker.submit(gate.wait)                    # the compile thread is busy with a slow schema
    for i in range(cache.max_pending):
        cache.compile_later({"type": "regex", "pattern": f"[0-9]{{{i + 1}}}"}, done(i))
    assert results == {} and cache.pending == cache.max_pending, "the caller's thread did not wait"
    cache.compile_later({"type": "regex", "pattern": "x+"}, done("over"))
    assert results["over"][0] is None and results["over"][1].startswith("busy:")
    gate.set()
    for _ in range(cache.max_pending + 1):
        assert arrived.acquire(timeout=60)
    assert all(results[i][0] is not None and results[i][1] == "" for i in range(cache.max_pending))
    cache.compile_later({"type": "regex", "pattern": "([a-z"}, done("broken"))
    assert arrived.acquire(timeout=60) and results["broken"][0] is None
    assert results["broken"][1].startswith("response_format: cannot be compiled") and cache.pending == 0
    cache.compile_later({"type": "regex", "pattern": "[0-9]{1}"}, done("cached"))
    assert results["cached"][0] is results[0][0], "a cached grammar is answered at once, on the caller's thread"


def test_compiled_grammars_are_bounded_in_bytes(smollm2_dir):
    from python_backends.engine.guided import GrammarCache

    cache = GrammarCache(str(smollm2_dir), 49152, cache_bytes=1)
    first = cache.compile({"type": "regex", "pattern": "[a-c]{2}"})
    cache.compile({"type": "regex", "pattern": "[d-f]{2}"})
    assert cache.cached({"type": "regex", "pattern": "[a-c]{2}"}) is None and len(cache._cache) == 1
    assert first.memory_size_bytes > 0


def test_stop_checker_equals_whole_text_search_and_costs_the_same_late(tokenizer):
    """The incremental checker finds what a search of the whole decoded text finds, and a token costs about
    the same at 4,000 output tokens as at 100 (before: the whole output was decoded twice per token)."""
    import random
    import time

    from python_backends.engine.stops import StopChecker

    rng = random.Random(3)
    text = " ".join(rng.choice(["the cat", "sat on", "a mat.", "héllo", "wörld", "END", "x"]) for _ in range(1500))
    ids = tokenizer.encode(text).ids[:4000]
    for stops in (["END"], ["mat. h", "zz"], ["ö"]):
        checker = StopChecker(tokenizer, stops)
        for n in range(1, len(ids) + 1):
            safe, hit = checker.update(ids[:n])
            full = tokenizer.decode(ids[:n], skip_special_tokens=True)
            first = min((p for p in (full.find(s) for s in stops) if p >= 0), default=-1)
            assert hit == (first >= 0), (stops, n)
            released = tokenizer.decode(ids[:safe], skip_special_tokens=True)
            assert not any(s in released for s in stops) and full.startswith(released.rstrip("\ufffd"))
            if hit:
                break
    checker = StopChecker(tokenizer, ["never-there"])
    costs = []
    for n in range(1, len(ids) + 1):
        t0 = time.perf_counter()
        checker.update(ids[:n])
        costs.append(time.perf_counter() - t0)
    early, late = sorted(costs[100:300])[100], sorted(costs[-200:])[100]   # medians: robust to a busy machine
    assert late < 2 * early + 20e-6, (early, late)
