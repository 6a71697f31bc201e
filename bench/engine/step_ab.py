"""Per-step A/B of two engine settings in one process, for changes smaller than the machine's drift.

On a shared 2-vCPU VM the same in-process run drifts by 30 % within minutes, so two runs one after the other
cannot show a 2 % change. Here two engines (settings A and B, e.g. `--b cpu_matmul=int8`) are built in one
process on the same OpenMP pool, each given the same streams, and their steps alternate one for one (who goes
first alternates too): a slow minute hits both alike. Reports each engine's median step time and B / A. With
no settings changed the ratio stays within ~1 % of 1 (1.004 and 0.991 in two runs of ~500 steps a side, 32 streams,
2-vCPU AMD EPYC): the harness's own noise. `--out` keeps the report as JSON (e.g. under bench/results/).

    python -m bench.engine.step_ab --b cpu_decode_attention=sdpa
    python -m bench.engine.step_ab --a cpu_matmul=bf16 --b cpu_matmul=int8 --streams 4 --tokens 256
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from bench.engine.workload import make_burst
from build_engines.cpu import smollm2_weights
from python_backends.engine.config import EngineConfig
from python_backends.engine.engine import LLMEngine
from python_backends.engine.sequence import SamplingParams

SETTINGS = {f.name for f in dataclasses.fields(EngineConfig)} - {"weights_dir", "extra"}


def parse_settings(items: list[str]) -> dict[str, str]:
    """`key=value` engine settings (EngineConfig's field names); a bad one raises ValueError naming it."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in SETTINGS:
            raise ValueError(f"{item!r}: expected key=value with key one of {', '.join(sorted(SETTINGS))}")
        out[key] = raw
    return out


def build(weights: str, settings: dict[str, str], streams: int) -> LLMEngine:
    """An engine on `weights` with the benchmark's pool and `settings` (typed by EngineConfig.from_params)."""
    params = {"num_kv_blocks": "2048", "max_num_seqs": str(max(streams, 1)), **settings, "weights_dir": weights}
    try:
        config = EngineConfig.from_params(params)
    except ValueError as exc:
        raise ValueError(f"engine settings {settings}: {exc}") from None
    return LLMEngine(config)


def alternate(engines: dict[str, LLMEngine], streams: int, tokens: int, rounds: int,
              skip: int | None = None) -> dict[str, list[float]]:
    """Step times (s) per engine: each round gives every engine the same `streams` greedy requests of `tokens`
    tokens (bench_engine's burst prompts) and steps them in turns until all are done; a round's first `skip`
    steps are not counted (default: the prefill steps, from the prompts' tokens and the step token budget, + 1)."""
    burst = make_burst(streams, output_tokens=tokens)
    if skip is None:
        budget = min(e.config.max_num_batched_tokens for e in engines.values())
        skip = -(-sum(len(r.prompt_ids) for r in burst) // budget) + 1
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(rounds):
        for eng in engines.values():
            for req in burst:
                eng.add_request(req.prompt_ids, SamplingParams(max_tokens=req.max_tokens, temperature=0.0,
                                                               ignore_eos=True))
        step = 0
        while any(e.has_work() for e in engines.values()):
            order = names if (r + step) % 2 == 0 else names[::-1]
            for name in order:
                if engines[name].has_work():
                    t = time.perf_counter()
                    engines[name].step()
                    if step >= skip:
                        times[name].append(time.perf_counter() - t)
            step += 1
    return times


def main(argv: list[str] | None = None) -> dict:
    from common.settings import load_settings
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="engine settings of A (default: none)")
    ap.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="engine settings of B")
    ap.add_argument("--streams", type=int, default=32, help="concurrent greedy streams per engine")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--weights", default="", help="weights dir (default: the cached SmolLM2-135M bf16)")
    ap.add_argument("--out", default="", help="also write the report (JSON) to this path")
    args = ap.parse_args(argv)
    try:
        a, b = parse_settings(args.a), parse_settings(args.b)
    except ValueError as exc:
        ap.error(str(exc))
    weights = args.weights or str(smollm2_weights(load_settings().cache_dir))
    try:
        engines = {"A": build(weights, a, args.streams), "B": build(weights, b, args.streams)}
    except ValueError as exc:
        ap.error(str(exc))
    times = alternate(engines, args.streams, args.tokens, args.rounds)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    report = {"a": a, "b": b, "streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
              "steps_per_side": len(times["A"]), "step_ms_median": med, "b_over_a": med["B"] / med["A"]}
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
