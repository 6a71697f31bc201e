"""GPU mode of the engine benchmark: the engine on a CUDA device vs transformers `generate` (static batches) on
the same device, same random-init weights, same dtype, one process; no real weights, no tokenizer, no Triton.

Models: random-init Llama shapes of SmolLM2-135M and Llama-3.2-1B. Workload per concurrency N: N prompts of
--prompt-len random ids submitted at t=0, --gen-len outputs each (or, with mixed lengths, uniform in
[gen_len/8, gen_len]: HF's static batch then runs to the longest), EOS ignored, greedy. Also measures the
decode step (wall time of `LLMEngine.step()` while all N sequences decode, and the CUDA-graph replay alone) and
checks fp32 greedy ids against HF on the device (mixed batch with chunked prefill, then a prefix-cache rerun).

    python -m bench.engine.gpu_bench --out bench/results/engine-gpu.json            # CUDA, the full run
    python -m bench.engine.gpu_bench --device cpu --smoke --out /tmp/smoke.json     # CPU, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # runnable as a script from a bare checkout

from bench.engine.random_models import random_hf_llama  # noqa: E402
from python_backends.engine.config import EngineConfig  # noqa: E402
from python_backends.engine.engine import LLMEngine  # noqa: E402
from python_backends.engine.sequence import SamplingParams  # noqa: E402

MODELS = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=1000, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_hf(name: str, dtype: torch.dtype, device: torch.device, seed: int):
    model = random_hf_llama(MODELS[name], device, dtype, seed, max_positions=131072)
    return model.config, model


def engine_for(model, tmp: Path, device: torch.device, dtype: str, max_seqs: int, max_context: int,
               step_tokens: int, kv_blocks: int, graphs: bool, async_decode: int = 0) -> LLMEngine:
    """The engine on the HF model's own tensors (config.json written from the HF config)."""
    d = model.config.to_dict()
    (tmp / "config.json").write_text(json.dumps(d, default=str))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = EngineConfig(weights_dir=str(tmp), dtype=dtype, device=str(device), max_context=max_context,
                       num_kv_blocks=kv_blocks, kv_memory_fraction=0.3, max_num_seqs=max_seqs,
                       max_num_batched_tokens=step_tokens, output_estimate=64, cuda_graphs=int(graphs), threads=1,
                       async_decode=async_decode)
    return LLMEngine(cfg, state_dict=sd)


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def _timed(obj, name: str, acc: dict) -> None:
    """Instrument obj.name (an instance attribute shadowing the method): seconds summed into acc[name]."""
    fn = getattr(type(obj), name).__get__(obj)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
    setattr(obj, name, wrapper)


def run_engine(eng: LLMEngine, prompts: list[list[int]], gen_lens: list[int], device: torch.device) -> dict:
    host: dict[str, float] = {}
    _timed(eng.scheduler, "schedule", host)
    _timed(eng.runner, "prepare", host)
    lookahead0 = eng.lookahead_steps
    sync(device)
    t0 = time.perf_counter()
    seqs = [eng.add_request(p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in zip(prompts, gen_lens)]
    out_tokens, steps, first_all = 0, 0, None
    full_decode_ms: list[float] = []            # steps where every sequence decodes together
    got_first: set[int] = set()
    while eng.has_work():
        ts = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - ts
        steps += 1
        out_tokens += sum(len(o.token_ids) for o in outs)
        if first_all is not None and len(outs) == len(seqs) and all(not o.finished for o in outs):
            full_decode_ms.append(1000 * dt)
        got_first.update(o.seq.seq_id for o in outs)
        if first_all is None and len(got_first) == len(seqs):
            first_all = time.perf_counter() - t0
    sync(device)
    wall = time.perf_counter() - t0
    del eng.scheduler.schedule, eng.runner.prepare
    assert all(s.finish_reason is not None and s.finish_reason.value == "length" for s in seqs), "not all finished"
    assert out_tokens == sum(gen_lens), (out_tokens, sum(gen_lens))
    return {"output_tokens": out_tokens, "wall_s": round(wall, 3), "output_tok_s": round(out_tokens / wall, 1),
            "steps": steps, "all_first_token_s": round(first_all or wall, 3),
            "decode_step_ms_median": round(statistics.median(full_decode_ms), 3) if full_decode_ms else None,
            "decode_steps_at_full_batch": len(full_decode_ms), "preemptions": eng.scheduler.num_preemptions,
            "lookahead_steps": eng.lookahead_steps - lookahead0,
            "host_ms_per_step": {k: round(1000 * v / steps, 3) for k, v in host.items()}}


def graph_replay_ms(eng: LLMEngine, n: int, device: torch.device, reps: int = 50) -> float | None:
    """Device time of one decode forward of n rows replayed from its CUDA graph (CUDA events)."""
    graphs = eng.runner.graphs
    if graphs is None or device.type != "cuda":
        return None
    b = graphs.bucket(n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.graphs[b].replay()
    start.record()
    for _ in range(reps):
        graphs.graphs[b].replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / reps, 3)


@torch.inference_mode()
def run_hf(model, prompts, gen_lens, device) -> dict:
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(gen_lens),
                         do_sample=False)
    sync(device)
    wall = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == max(gen_lens), out.shape
    return {"output_tokens": sum(gen_lens), "wall_s": round(wall, 3), "output_tok_s": round(sum(gen_lens) / wall, 1)}


@torch.inference_mode()
def check_greedy(name: str, device: torch.device, seed: int, tmp: Path) -> dict:
    """fp32, same weights: engine greedy ids == HF greedy ids, prompts of different lengths in one batch with
    chunked prefill (decodes run from CUDA graphs), then a prefix-cache rerun of the first prompt."""
    cfg, model = build_hf(name, torch.float32, device, seed)
    prompts = prompts_for(4, 40, cfg.vocab_size, seed + 7)
    prompts[1], prompts[2] = prompts[1][:23], prompts[2][:35]
    n = 12
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        ref.append(model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  do_sample=False)[0, len(p):].tolist())
    eng = engine_for(model, tmp, device, "fp32", 8, 128, 16, 256, True)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    got: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    while eng.has_work():
        for o in eng.step():
            got[o.seq.seq_id].extend(o.token_ids)
    again = eng.add_request(prompts[0], SamplingParams(max_tokens=n, ignore_eos=True))
    rerun: list[int] = []
    while eng.has_work():
        for o in eng.step():
            rerun.extend(o.token_ids)
    equal = [got[s.seq_id] == r for s, r in zip(seqs, ref)]
    res = {"system": "check", "model": name, "device": str(device), "dtype": "fp32",
           "greedy_equal_to_hf": f"{sum(equal)}/{len(equal)}", "all_equal": all(equal),
           "prefix_cache_rerun_equal": rerun == got[seqs[0].seq_id], "cached_prompt_tokens": again.num_cached_prompt,
           "graphs": eng.runner.graphs is not None}
    del eng, model
    return res


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_model(name: str, args, device: torch.device, tmp: Path, emit) -> None:
    cfg, model = build_hf(name, DTYPES[args.dtype], device, args.seed)
    top = max(args.concurrency)
    max_context = args.prompt_len + args.gen_len + 16
    kv_blocks = 0 if device.type == "cuda" else top * (-(-max_context // 16)) + 64    # CUDA: from free memory
    t = time.perf_counter()
    eng = engine_for(model, tmp, device, args.dtype, top, max_context, args.step_tokens, kv_blocks, True,
                     args.async_decode)
    emit({"system": "engine-setup", "model": name, "setup_s": round(time.perf_counter() - t, 2),
          "kv_blocks": eng.runner.num_blocks, "graph_buckets": eng.runner.graphs.buckets if eng.runner.graphs else [],
          "graph_error": eng.runner.graph_error})
    warm = prompts_for(2, 32, cfg.vocab_size, 999)
    run_engine(eng, warm, [4, 4], device)
    cases = []
    for mixed in args.lengths:
        for n in args.concurrency:
            prompts = prompts_for(n, args.prompt_len, cfg.vocab_size, args.seed + n + (5000 if mixed else 0))
            gen = [args.gen_len] * n
            if mixed:
                rng = random.Random(args.seed + 10_000 + n)
                gen = [rng.randint(max(1, args.gen_len // 8), args.gen_len) for _ in range(n)]
                gen[0] = args.gen_len
            cases.append((n, mixed, prompts, gen))
    base = {"model": name, "device": str(device), "dtype": args.dtype, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len}
    for n, mixed, prompts, gen in cases:
        runs = [run_engine(eng, prompts, gen, device) for _ in range(args.repeats)]
        r = max(runs, key=lambda x: x["output_tok_s"])           # best of the repeats (allocator, JIT warm)
        r["output_tok_s_all"] = [x["output_tok_s"] for x in runs]
        r["graph_replay_ms"] = graph_replay_ms(eng, n, device)
        emit({"system": "engine", **base, "mixed_lengths": mixed, "concurrency": n, **r})
    del eng
    free(device)
    if "hf" in args.systems:
        run_hf(model, warm, [4, 4], device)
        for n, mixed, prompts, gen in cases:
            try:
                runs = [run_hf(model, prompts, gen, device) for _ in range(args.repeats)]
                r = max(runs, key=lambda x: x["output_tok_s"])
                r["output_tok_s_all"] = [x["output_tok_s"] for x in runs]
                emit({"system": "hf", **base, "mixed_lengths": mixed, "concurrency": n, **r})
            except Exception as exc:   # e.g. out of memory: recorded, the run goes on
                emit({"system": "hf", **base, "mixed_lengths": mixed, "concurrency": n, "error": repr(exc)[:300]})
            free(device)
    del model
    free(device)


def ratios(results: list[dict]) -> list[dict]:
    key = lambda d: (d.get("model"), d.get("concurrency"), d.get("mixed_lengths"))  # noqa: E731
    hf = {key(d): d for d in results if d.get("system") == "hf" and "output_tok_s" in d}
    out = []
    for d in results:
        h = hf.get(key(d))
        if d.get("system") == "engine" and h:
            out.append({"system": "ratio", "model": d["model"], "concurrency": d["concurrency"],
                        "mixed_lengths": d["mixed_lengths"], "engine_tok_s": d["output_tok_s"],
                        "hf_tok_s": h["output_tok_s"], "engine_over_hf": round(d["output_tok_s"] / h["output_tok_s"], 2),
                        "decode_step_ms_median": d["decode_step_ms_median"], "graph_replay_ms": d["graph_replay_ms"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.2-1b"], choices=list(MODELS))
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--lengths", default="fixed,mixed", help="fixed, mixed or both (comma-separated)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--step-tokens", type=int, default=8192, help="engine max_num_batched_tokens")
    ap.add_argument("--systems", default="engine,hf")
    ap.add_argument("--repeats", type=int, default=2, help="runs per case for each system; the best counts")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 greedy equality check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-decode", type=int, default=0, choices=[0, 1],
                    help="engine async_decode: 1 = launch decode step N+1 before step N's ids reach the host")
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (CPU, seconds)")
    ap.add_argument("--out", type=Path, default=None, help="write all results here as JSON")
    ap.add_argument("--doc-from", type=Path, help="only render docs/benchmarks.md's `### GPU` from a results JSON")
    args = ap.parse_args()
    if args.doc_from:
        from bench.engine.report_doc import gpu_section, replace_subsection
        from common.settings import REPO_ROOT
        results = json.loads(args.doc_from.read_text())
        replace_subsection("GPU", gpu_section(results, "bash bench/engine/gpu_suite.sh  # = python -m "
                                              "bench.engine.gpu_bench after the CUDA tests",
                                              str(args.doc_from.resolve().relative_to(REPO_ROOT))))
        return
    if args.smoke:
        args.models, args.concurrency, args.prompt_len, args.gen_len, args.step_tokens = ["tiny"], [2, 4], 40, 8, 32
        args.repeats = 1
    args.lengths = [x == "mixed" for x in args.lengths.split(",")]
    device = torch.device(args.device)
    results: list[dict] = []

    def emit(d: dict) -> None:
        results.append(d)
        print(json.dumps(d), flush=True)
        if args.out:                      # rewritten after every result: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    import transformers
    emit({"system": "env", "torch": torch.__version__, "transformers": transformers.__version__,
          "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    with tempfile.TemporaryDirectory() as td:
        for name in args.models:
            if not args.no_check:
                try:
                    emit(check_greedy(name, device, args.seed, Path(td)))
                except Exception as exc:
                    emit({"system": "check", "model": name, "error": repr(exc)[:500]})
                free(device)
            bench_model(name, args, device, Path(td), emit)
    for r in ratios(results):
        emit(r)


if __name__ == "__main__":
    main()
