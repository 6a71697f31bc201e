"""Structured output on the CPU engine, in-process (no platform): grammar compile time for a 50-field JSON
schema, tokens/s of 32 concurrent greedy streams with half of them constrained by a JSON schema vs none
constrained (same prompts, same max_tokens, ignore_eos so both generate the same tokens; pairs alternated), and how many of 20 prompts give a value that
validates against a pydantic model (nested object, enum, array, bounded numbers).

    .venv/bin/python -m bench.api.structured_output [--out bench/results/api-structured-output.json]

The machine may be shared: the load average is recorded with the numbers; ratios come from one run.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.api.person import Person
from build_engines.cpu import smollm2_weights
from common.settings import load_settings
from python_backends.engine.config import EngineConfig
from python_backends.engine.engine import LLMEngine
from python_backends.engine.sequence import SamplingParams


PROMPTS = ["Describe a fictional person.", "Invent a painter from Lyon.", "Who is Ada?", "Describe a cook.",
           "Make up a sailor.", "Describe a teacher from Oslo.", "Invent a chess player.", "Describe a baker.",
           "Describe a pilot.", "Invent a poet.", "Describe a runner from Nairobi.", "Make up a gardener.",
           "Describe a doctor.", "Invent a musician.", "Describe a child.", "Invent an astronaut.",
           "Describe a farmer.", "Make up a detective.", "Describe a nurse from Lima.", "Invent a carpenter."]


def fifty_fields() -> dict:
    kinds = [{"type": "integer", "minimum": 0, "maximum": 1000}, {"type": "string", "maxLength": 16},
             {"type": "number"}, {"type": "boolean"}, {"type": "string", "enum": ["a", "b", "c"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def chat_ids(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, list]:
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    start = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            outs[o.seq.seq_id] += o.token_ids
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(v) for v in outs.values()), [(s, outs[s.seq_id]) for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/api-structured-output.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="plain/mixed pairs, alternated (the machine drifts)")
    args = ap.parse_args()
    from openai.lib._pydantic import to_strict_json_schema
    from transformers import AutoTokenizer

    load_before = os.getloadavg()
    weights = smollm2_weights(load_settings().cache_dir)
    tok = AutoTokenizer.from_pretrained(weights)
    engine = LLMEngine(EngineConfig(weights_dir=str(weights), dtype="bf16", num_kv_blocks=2048, max_context=2048,
                                    max_num_seqs=64, threads=2))
    cache = engine.grammars()
    t0 = time.perf_counter()
    cache.compile({"type": "json_schema", "schema": fifty_fields()})
    compile_50 = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.compile({"type": "json_schema", "schema": fifty_fields()})
    cached_50 = time.perf_counter() - t0

    person = {"type": "json_schema", "schema": to_strict_json_schema(Person)}
    ids = [chat_ids(tok, p) for p in PROMPTS]
    valid, lengths = 0, []
    for p in ids:   # the 20 prompts, one at a time
        _, n, [(seq, out)] = run(engine, [p], [SamplingParams(max_tokens=200, guided=person)])
        lengths.append(n)
        try:
            Person.model_validate_json(tok.decode(out))
            valid += 1
        except ValueError:
            pass

    prompts32 = [ids[i % len(ids)] for i in range(32)]
    run(engine, prompts32[:4], [SamplingParams(max_tokens=8) for _ in range(4)])   # warm-up
    plain_s = mixed_s = 0.0
    plain_n = mixed_n = 0
    for _ in range(args.rounds):   # ignore_eos: both runs generate the same number of tokens
        s, n, _ = run(engine, prompts32, [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                                          for _ in range(32)])
        plain_s, plain_n = plain_s + s, plain_n + n
        s, n, _ = run(engine, prompts32, [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                                         guided=person if i % 2 else None) for i in range(32)])
        mixed_s, mixed_n = mixed_s + s, mixed_n + n
    result = {
        "what": "CPU engine in-process, SmolLM2-135M bf16, greedy",
        "grammar_compile_50_fields_s": round(compile_50, 4), "grammar_cached_lookup_s": round(cached_50, 6),
        "pydantic_person_valid": f"{valid}/{len(PROMPTS)}", "pydantic_person_tokens": lengths,
        "streams": 32, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "loadavg_before": load_before,
        "none_constrained": {"tokens": plain_n, "seconds": round(plain_s, 3), "tok_per_s": round(plain_n / plain_s, 1)},
        "half_constrained": {"tokens": mixed_n, "seconds": round(mixed_s, 3), "tok_per_s": round(mixed_n / mixed_s, 1)},
        "loadavg_after": os.getloadavg(),
    }
    result["overhead_tok_per_s_pct"] = round(100 * (1 - result["half_constrained"]["tok_per_s"]
                                                     / result["none_constrained"]["tok_per_s"]), 1)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
