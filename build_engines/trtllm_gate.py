"""The quality gate of the TensorRT-LLM build, on the GPU node (not run on the CPU machines; docs/build_engines.md).

Same evaluation set, reference and metrics as the cpu gate (build_engines.quality_gate): the checkpoint's own
transformers run in fp32 (spread over the node's GPUs with device_map="auto"), then the candidate scored
teacher-forced at the same positions. The candidate is a small second engine built by `trtllm-build` from the
very TensorRT-LLM checkpoint (the converted or ModelOpt-quantised weights) with the serving engine's plugins and
fp8 settings plus `--gather_context_logits`, which the serving engine does without (logits of every prompt token
cost memory at serving batch sizes). It runs under TensorRT-LLM's runtime `ModelRunner`, one MPI rank per GPU for
tensor parallel engines. Two steps, each its own process so the reference's GPU memory is free before the
engine loads:

    python3 -m build_engines.trtllm_gate reference --checkpoint HF_DIR --out ref.json [--prompts N --tokens T]
    mpirun -n TP python3 -m build_engines.trtllm_gate score --engine-dir GATE_ENGINE --reference ref.json \\
        --dtype fp8 --out report.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from build_engines.quality_gate import GateOptions, Reference, Scored, make_report, parse_threshold, \
    score_positions

GATE_BATCH, GATE_SEQ = 8, 512   # the gate engine's shape: the eval set's prompts + continuations fit
ENGINE_NAME = "tensorrt_llm ModelRunner (gate engine: same checkpoint, --gather_context_logits)"


def gate_commands(build_cmd: list[str], ckpt_dir: Path, work_dir: Path, hf: str, dtype: str, tp: int,
                  gate: GateOptions) -> tuple[list[list[str]], Path]:
    """The gate's planned steps after the serving engine's `trtllm-build` (whose flags it reuses)."""
    engine, ref, report = work_dir / "gate_engine", work_dir / "gate_reference.json", work_dir / "quality_gate.json"
    flags, i = {}, 1
    skip = {"--lora_plugin", "--lora_target_modules", "--max_lora_rank"}  # the gate scores the base model
    while i < len(build_cmd):
        key, j = build_cmd[i], i + 1
        while j < len(build_cmd) and not build_cmd[j].startswith("--"):
            j += 1
        if key not in skip:
            flags[key] = build_cmd[i + 1:j]
        i = j
    flags.update({"--output_dir": [str(engine)], "--max_batch_size": [str(GATE_BATCH)],
                  "--max_input_len": [str(GATE_SEQ - 1)], "--max_seq_len": [str(GATE_SEQ)],
                  "--max_num_tokens": [str(GATE_BATCH * GATE_SEQ)], "--gather_context_logits": []})
    gate_build = ["trtllm-build", *[x for k, v in flags.items() for x in (k, *v)]]
    size = ["--prompts", str(gate.prompts), "--tokens", str(gate.gen_tokens)]
    mpi = ["mpirun", "--allow-run-as-root", "-n", str(tp)] if tp > 1 else []
    thresholds = [x for k, v in gate.thresholds.items() for x in ("--threshold", f"{k}={v}")]
    return ([gate_build,
             ["python3", "-m", "build_engines.trtllm_gate", "reference", "--checkpoint", hf, *size, "--out", str(ref)],
             [*mpi, "python3", "-m", "build_engines.trtllm_gate", "score", "--engine-dir", str(engine),
              "--reference", str(ref), "--dtype", dtype, *size, *thresholds, "--out", str(report)]], report)


def engine_scores(engine_dir: Path, ref: Reference) -> Scored | None:
    """Teacher-forced scores from the gate engine (rank 0 returns them; other ranks None)."""
    import tensorrt_llm
    import torch
    from tensorrt_llm.runtime import ModelRunner

    rank = tensorrt_llm.mpi_rank()
    runner = ModelRunner.from_dir(engine_dir=str(engine_dir), rank=rank)
    top1: list[list[int]] = []
    logprobs: list[list[float]] = []
    pairs = list(zip(ref.prompt_ids, ref.continuation))
    for start in range(0, len(pairs), GATE_BATCH):
        group = pairs[start:start + GATE_BATCH]
        ids = [torch.tensor(p + c[:-1], dtype=torch.int32) for p, c in group]
        with torch.no_grad():
            out = runner.generate(batch_input_ids=ids, max_new_tokens=1, end_id=0, pad_id=0,
                                  output_sequence_lengths=True, return_dict=True)
        torch.cuda.synchronize()
        if rank != 0:
            continue
        context = out["context_logits"]  # per request [input length, vocab] (a list, or a padded tensor)
        for j, (p, c) in enumerate(group):
            t1, lp = score_positions(context[j][len(p) - 1:len(p) - 1 + len(c)], c)
            top1.append(t1)
            logprobs.append(lp)
    return Scored(top1, logprobs) if rank == 0 else None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m build_engines.trtllm_gate", description=__doc__.split("\n\n")[0],
                                 exit_on_error=False)
    ap.add_argument("step", choices=("reference", "score"))
    ap.add_argument("--checkpoint", help="reference: the Hugging Face folder")
    ap.add_argument("--engine-dir", help="score: the gate engine (built with --gather_context_logits)")
    ap.add_argument("--reference", help="score: the reference step's output")
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("--prompts", type=int, default=GateOptions().prompts)
    ap.add_argument("--tokens", type=int, default=GateOptions().gen_tokens)
    ap.add_argument("--threshold", action="append", default=[])
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    opts = GateOptions(prompts=args.prompts, gen_tokens=args.tokens,
                       thresholds=dict(parse_threshold(t) for t in args.threshold))
    if args.step == "reference":
        from build_engines.gate_reference import compute_reference
        ref = compute_reference(Path(args.checkpoint), opts, device_map="auto")
        Path(args.out).write_text(json.dumps(ref.__dict__))
        return 0
    ref = Reference(**json.loads(Path(args.reference).read_text()))
    got = engine_scores(Path(args.engine_dir), ref)
    if got is not None:
        Path(args.out).write_text(json.dumps(make_report(ref, got, args.dtype, opts, ENGINE_NAME, {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
