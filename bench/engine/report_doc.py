"""The `## Engine` section of docs/benchmarks.md, rendered from benchmark results: a `### CPU` part (bench_engine,
through Triton, vs transformers and llama-server) and a `### GPU` part (gpu_bench, vs transformers on the same
GPU). Each renderer replaces only its own subsection, so either benchmark can be rerun alone."""
from __future__ import annotations

from common.settings import REPO_ROOT

DOC = REPO_ROOT / "docs" / "benchmarks.md"
INTRO = ("The engine (python_backends/engine) on the CPU, served by tritonserver, and on one CUDA GPU. "
         "CPU: `python -m bench.engine.bench_engine`; GPU: `python -m bench.engine.gpu_bench` (or "
         "`bash bench/engine/gpu_suite.sh`, which runs the CUDA tests first).")


def replace_subsection(title: str, body: str) -> None:
    """Put `### {title}` + body inside `## Engine` (created if missing), replacing that subsection only."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = f"### {title}\n\n{body.strip()}\n"
    if "\n## Engine\n" not in text:
        text = text.rstrip("\n") + f"\n\n## Engine\n\n{INTRO}\n\n{block}"
    else:
        head, rest = text.split("\n## Engine\n", 1)
        end = rest.find("\n## ")
        engine, tail = (rest, "") if end < 0 else (rest[:end], rest[end:])
        marker = f"\n### {title}\n"
        if marker in engine:
            before, after = engine.split(marker, 1)
            nxt = after.find("\n### ")
            engine = before + "\n" + block + ("" if nxt < 0 else after[nxt:])
        else:
            engine = engine.rstrip("\n") + "\n\n" + block
        text = head + "\n## Engine\n" + engine.rstrip("\n") + "\n" + tail
    DOC.write_text(text)


def _f(v, d: int = 0) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def _tok_s(s: dict) -> str:
    """Throughput; with repeated runs, the median and the range of the runs."""
    runs = s.get("throughput_tok_s_runs")
    if not runs or len(runs) < 2:
        return _f(s["throughput_tok_s"], 1)
    return f"{_f(s['throughput_tok_s'], 1)} ({min(runs):.0f}-{max(runs):.0f})"


def _paired_range(ours: dict, peer: dict) -> str:
    """With repeated runs, the range of the run-by-run ratios (round k of ours over round k of the peer)."""
    a, b = ours.get("throughput_tok_s_runs"), peer.get("throughput_tok_s_runs")
    if not a or not b or len(a) != len(b) or len(a) < 2 or not all(b):
        return ""
    ratios = [x / y for x, y in zip(a, b)]
    return f" (rounds {min(ratios):.2f}-{max(ratios):.2f}x)"


def cpu_section(report: dict, command: str) -> str:
    rows = ["| workload | concurrency | system | tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms | "
            "ITL p50 ms | peak RSS MB | load avg before | CPU busy before % |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for key in report["levels"]:
        kind, conc = key.split("-")
        for system in ("platform", "engine", "hf", "llama"):
            s = report["systems"].get(system, {}).get(key)
            if s:
                rows.append(f"| {kind} | {conc} | {system} | {_tok_s(s)} | {_f(s['ttft_ms_p50'])} | "
                            f"{_f(s['ttft_ms_p95'])} | {_f(s.get('tpot_ms_p50'), 1)} | {_f(s.get('tpot_ms_p95'), 1)} | "
                            f"{_f(s['itl_ms_p50'], 1)} | "
                            f"{_f(s.get('peak_rss_mb'))} | {s.get('load_avg_before', '-')} | {_f(s.get('cpu_busy_before'))} |")
        parts = []
        for ours in ("platform", "engine"):
            o = report["systems"].get(ours, {}).get(key)
            for peer in ("hf", "llama"):
                p = report["systems"].get(peer, {}).get(key)
                if o and p and p["throughput_tok_s"]:
                    parts.append(f"{ours} throughput {o['throughput_tok_s'] / p['throughput_tok_s']:.2f}x {peer}"
                                 + _paired_range(o, p))
                    if p.get("ttft_ms_p95"):
                        parts.append(f"{ours} TTFT p95 {o['ttft_ms_p95'] / p['ttft_ms_p95']:.2f}x {peer}")
            metric = "tpot" if o and o.get("tpot_ms_p50") else "itl"   # results from before TPOT: ITL
            if o and conc == "1" and o.get(f"{metric}_ms_p50"):
                parts.append(f"{ours} single-stream decode {1000 / o[f'{metric}_ms_p50']:.1f} tok/s "
                             f"(1 / {metric.upper()} p50)")
        e = report["systems"].get("engine", {}).get(key) or {}
        if e and kind == "poisson":
            parts.append(f"prefix cache saved {100 * e['prefix_saved_shared']:.0f} % of the shared-prompt requests' "
                         f"prefill ({100 * e['prefix_saved_all']:.0f} % of all prompt tokens)")
        if e.get("kv_overhead_max"):
            parts.append(f"KV blocks in use / resident tokens max {e['kv_overhead_max']:.3f}x")
        notes.append(f"- {kind} c={conc}: " + ", ".join(parts))
    notes += [f"- {n}" for n in report.get("notes", [])]
    about = ("Our whole platform (`platform`: `fleet up`, every request through the router's KServe gRPC stream "
             "with an API key to one engine replica; usage metered through Kafka as in production) and our engine's "
             "replica alone (`engine`: tritonserver's decoupled model `engine`, gRPC streaming, no router) vs "
             "transformers `generate` with static batches (batch = concurrency, left padding, runs to the longest "
             "output of the batch) vs llama.cpp `llama-server --parallel N` (Q4_1 GGUF, `cache_prompt`), one after "
             "another, same CPU threads each. Workloads (token ids, EOS ignored): `burst` = all requests at once, "
             "20-60-token prompts, 128 output tokens each; `poisson` = Poisson arrivals, prompts of 100-1,000 "
             "tokens, half with one shared 300-token system prompt, outputs of 16-256 tokens. Throughput = output "
             "tokens / makespan; TTFT from arrival (client-side queueing included); TPOT = a request's time per "
             "output token after its first; ITL = gaps between streamed tokens (0 inside a response of several "
             "tokens: our engine's `stream_interval`, which grows with a step's rows); peak RSS of each system's processes (the replica's for `engine`; not sampled for `platform`). "
             "Our client keeps all of a level's gRPC streams on one channel and one event loop, as a calling service "
             "would; each system is measured once the host is quiet (< 15 % CPU busy over 1 s, the reading in the "
             "table).")
    return "\n".join([about, "", f"Command: `{command}`  ", f"Run: {report['started']} (load average at start "
                      f"{report['load_avg']}), requests per level {report['requests_per_level']}, Poisson rate "
                      f"{report['rate']}/s, dtype {report['dtype']} (our CPU GEMMs: "
                      f"{report.get('cpu_matmul') or 'as the dtype'}; transformers: "
                      f"{report.get('hf_dtype', report['dtype'])}), {report['threads']} CPU thread(s) per system, our engine's "
                      f"stream_interval {report.get('stream_interval', 1)}" + (
                          f"; {report['repeats']} runs per system and level, taking turns, medians shown (range of "
                          f"the runs in brackets)." if report.get("repeats", 1) > 1 else "."),
                      "", *rows, "", *notes, "", f"Raw results: `{report['path']}`"])


def gpu_section(results: list[dict], command: str, path: str) -> str:
    env = next((r for r in results if r.get("system") == "env"), {})
    checks = [r for r in results if r.get("system") == "check"]
    ratios = [r for r in results if r.get("system") == "ratio"]
    engine = {(r["model"], r["concurrency"], r["mixed_lengths"]): r for r in results if r.get("system") == "engine"}
    rows = ["| model shape | outputs | streams | engine tok/s | HF tok/s | engine / HF | decode step ms (wall) | "
            "graph replay ms | host ms/step (schedule + prepare) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        e = engine[(r["model"], r["concurrency"], r["mixed_lengths"])]
        host = e.get("host_ms_per_step", {})
        rows.append(f"| {r['model']} | {'mixed' if r['mixed_lengths'] else 'fixed'} | {r['concurrency']} | "
                    f"{r['engine_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['engine_over_hf']:.2f}x | "
                    f"{_f(r['decode_step_ms_median'], 2)} | {_f(r['graph_replay_ms'], 2)} | "
                    f"{_f(host.get('schedule', 0) + host.get('prepare', 0), 2)} |")
    check = "; ".join(f"{c['model']}: {c.get('greedy_equal_to_hf', c.get('error'))} prompts equal, prefix-cache "
                      f"rerun equal: {c.get('prefix_cache_rerun_equal')}" for c in checks)
    args = env.get("args", {})
    return "\n".join([
        f"{env.get('device_name', '?')}, torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}; "
        f"random-init Llama shapes (SmolLM2-135M; Llama-3.2-1B with its llama3 RoPE scaling), dtype "
        f"{args.get('dtype')}, {args.get('prompt_len')}-token prompts, {args.get('gen_len')} output tokens (mixed: "
        f"uniform in [{args.get('gen_len', 8) // 8}, {args.get('gen_len')}], HF's static batch runs to the longest), "
        f"all streams submitted at once, EOS ignored, greedy. Engine: paged-attention Triton kernel, decode "
        f"steps replayed from CUDA graphs (batch buckets 1-256), step budget {args.get('step_tokens')} tokens, KV "
        f"pool sized from free memory. HF: `generate` with one static batch of all streams. Each case ran "
        f"{args.get('repeats', 1)} times per system, the best counts (the first HF run pays CUDA allocator "
        "growth: up to 3x slower). Decode step = wall time of `LLMEngine.step()` while every stream decodes "
        "(median); graph replay = device time of that step's CUDA graph alone.", "",
        f"Command: `{command}`", "", *rows, "",
        f"- fp32 greedy equality with HF on the GPU (4 prompts of different lengths in one batch, chunked "
        f"prefill, decodes from CUDA graphs): {check}.",
        "- The difference between the decode step and the graph replay is host time (Python scheduling, "
        "metadata packing, one sync per step): the CPU does not yet prepare step N+1 while the GPU runs step N.",
        "", f"Raw results: `{path}`"])
