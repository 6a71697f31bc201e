"""The quality gate's candidate on the cpu target: our engine (python_backends.engine, CPU) loading the converted
weights folder exactly as a replica does, scored teacher-forced at the reference's positions.

One real forward per prompt through the engine's model runner (prompt + reference continuation minus its last
token, logits at every continuation position), the same path a prefill takes in serving.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rich.progress import Progress

from build_engines import gate_reference, stage
from build_engines.quality_gate import GateOptions, Reference, Scored, run_gate, score_positions

ENGINE_NAME = "python_backends.engine (cpu)"
# One intra-op thread: build nodes are shared, and with more runnable threads than cores torch's spinning
# thread pool collapses (SmolLM2's 48 prompts, load average 9 on 2 cores: 16.6 s with 1 thread, 57.7 s with 2).
GATE_THREADS = 1


def engine_scores(weights_dir: Path, dtype: str, ref: Reference, threads: int = GATE_THREADS) -> Scored:
    import torch

    from python_backends.engine.batch import SeqChunk
    from python_backends.engine.config import EngineConfig
    from python_backends.engine.engine import LLMEngine

    longest = max(len(p) + len(c) for p, c in zip(ref.prompt_ids, ref.continuation))
    block = 16
    blocks = -(-longest // block)
    engine = LLMEngine(EngineConfig(weights_dir=str(weights_dir), dtype=dtype, device="cpu",
                                    max_context=blocks * block, block_size=block, num_kv_blocks=blocks + 2,
                                    max_num_seqs=1, max_num_batched_tokens=blocks * block, threads=threads))
    runner = engine.runner
    top1: list[list[int]] = []
    logprobs: list[list[float]] = []
    with torch.inference_mode(), Progress(transient=True, console=stage.console) as bar:
        task = bar.add_task(f"quality gate: engine {dtype} ({len(ref.prompt_ids)} prompts)",
                            total=len(ref.prompt_ids))
        for prompt, cont in zip(ref.prompt_ids, ref.continuation):
            ids = prompt + cont[:-1]
            batch = runner.prepare([SeqChunk(ids, 0, list(range(1, 1 + -(-len(ids) // block))), True)])
            batch.logits_rows = torch.arange(len(prompt) - 1, len(ids), device=runner.device)
            t1, lp = score_positions(runner.forward(batch), cont)
            top1.append(t1)
            logprobs.append(lp)
            bar.advance(task)
    return Scored(top1, logprobs)


def cpu_gate(checkpoint: Path, checkpoint_sha256: str, weights_dir: Path, weights_sha256: str, dtype: str,
             opts: GateOptions, cache_dir: Path) -> dict[str, Any]:
    """The cpu build's gate: reference (cached per checkpoint) vs our engine on the converted weights. The
    engine's scores are cached per (converted weights' sha256, reference): the same bytes give the same
    numbers, so a rebuild from the conversion cache re-uses them, and any changed byte runs the engine again."""
    ref_file = gate_reference.cache_path(cache_dir, checkpoint_sha256, opts)
    key = hashlib.sha256(json.dumps([weights_sha256, ref_file.name, dtype]).encode()).hexdigest()[:24]
    scored_file = cache_dir / "quality-gate" / f"engine-{key}.json"
    cached: dict[str, bool] = {"engine_cached": False}

    def scores(ref: Reference) -> Scored:
        try:
            got = Scored(**json.loads(scored_file.read_text()))
            cached["engine_cached"] = True
            return got
        except (OSError, json.JSONDecodeError, TypeError):
            pass
        got = engine_scores(weights_dir, dtype, ref)
        scored_file.parent.mkdir(parents=True, exist_ok=True)
        scored_file.with_suffix(".partial").write_text(json.dumps(got.__dict__))
        scored_file.with_suffix(".partial").rename(scored_file)
        return got

    report = run_gate(lambda: gate_reference.reference(checkpoint, checkpoint_sha256, opts, cache_dir), scores,
                      dtype, opts, ENGINE_NAME)
    report["candidate"] = {"weights_sha256": weights_sha256, **cached}
    return report
