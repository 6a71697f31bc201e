"""Target `trtllm`: the TensorRT-LLM engine build for GPU nodes, and the Triton repository that serves it.

Written against TensorRT-LLM 0.17 (tensorrtllm_backend v0.17.0), whose tools ship in NVIDIA's Triton
TRT-LLM container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3) with the TensorRT-LLM
examples mounted at --trtllm-examples (see docs/build_engines.md). The steps, in order:

1. checkpoint: `python <examples>/quantization/quantize.py --qformat fp8 --tp_size N` (ModelOpt fp8 with
   calibration; `--kv_cache_dtype fp8` only when --kv-cache-dtype fp8 is chosen, a separate decision: with fp16
   weights that is `--qformat full_prec --kv_cache_dtype fp8`) or `python <examples>/llama/convert_checkpoint.py`
2. engine: `trtllm-build` with paged KV cache, paged context FMHA (needed for KV-cache reuse and chunked
   context), removed input padding, the gemm/attention plugins, the LoRA plugin for the small base model,
   and max batch size / num tokens / input and sequence lengths
3. LoRA engines: every PEFT adapter under the adapters folder converted to TensorRT-LLM's LoRA tensors
   (build_engines.lora_convert, the layout of TensorRT-LLM's hf_lora_convert.py) beside its PEFT files;
4. tokenizer files copied next to the engine; the Triton repository rendered with the `tensorrt_llm`
   model (inflight fused batching, decoupled streaming, kv_cache_free_gpu_mem_fraction, KV-cache reuse,
   LoRA cache) and the GPU preprocessing / postprocessing; then staged and registered like the cpu target.

TensorRT-LLM cannot be installed on the CPU machines: there `--dry-run` prints the plan and configs,
and a real run stops before any work with an error that says where to run it.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.settings import REPO_ROOT, Settings

from build_engines import stage, triton_repo
from build_engines.layout import BuildResult, artefacts_ok, clean_stale_partials, store_uri, version_dir
from build_engines.plan import (BuildError, BuildOptions, BuildPlan, inputs_fingerprint, inspect_checkpoint,
                                precheck_checkpoint, resolve)
from build_engines.quality_gate import GateOptions
from build_engines.register import Registration, check_existing, read_row

TRTLLM_VERSION = "0.17.0"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3"
TEMPLATES = REPO_ROOT / "model_repository"
GPU_TEMPLATES = {"llm": TEMPLATES / "gpu" / "llm", "preprocessing": TEMPLATES / "gpu" / "preprocessing",
                 "tensorrt_llm": TEMPLATES / "tensorrt_llm", "postprocessing": TEMPLATES / "gpu" / "postprocessing"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "config.json", "chat_template.jinja")
HF_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp8": "float16"}
TOKENS_PER_BLOCK = 64  # KV-cache block size given to trtllm-build; postprocessing turns reused blocks into tokens


@dataclass(frozen=True)
class TrtllmPlan:
    """The exact commands and Triton config values of one TensorRT-LLM build."""
    commands: list[list[str]]
    values: dict[str, str]
    work_dir: Path
    engine_dir: Path      # where the engine is built (inside work_dir)
    serve_engine_dir: Path  # where replicas read it (node-local cache)
    tokenizer_dir: Path

    def shell(self) -> str:
        return "\n".join(shlex.join(c) for c in self.commands)


def plan_trtllm(plan: BuildPlan, work_dir: Path, serve_dir: Path, adapters_dir: Path,
                examples_dir: str) -> TrtllmPlan:
    """Commands + config values; paths: work_dir (build scratch), serve_dir (the version's node-local folder)."""
    o, tp = plan.opts, plan.tensor_parallel
    hf = str(plan.ckpt.path)
    ckpt_dir, engine_dir = work_dir / "trtllm_checkpoint", work_dir / "engine"
    base_dtype = HF_DTYPE[plan.dtype]
    kv_fp8 = o.kv_cache_dtype == "fp8"
    if plan.dtype == "fp8" or kv_fp8:  # ModelOpt: fp8 weights and/or fp8 KV-cache scales need calibration
        convert = ["python3", f"{examples_dir}/quantization/quantize.py", "--model_dir", hf,
                   "--dtype", base_dtype, "--qformat", "fp8" if plan.dtype == "fp8" else "full_prec",
                   *(["--kv_cache_dtype", "fp8"] if kv_fp8 else []),
                   "--calib_size", str(o.calib_size), "--tp_size", str(tp), "--pp_size", "1",
                   "--output_dir", str(ckpt_dir)]
    else:
        convert = ["python3", f"{examples_dir}/llama/convert_checkpoint.py", "--model_dir", hf,
                   "--dtype", base_dtype, "--tp_size", str(tp), "--pp_size", "1", "--workers", str(tp),
                   "--output_dir", str(ckpt_dir)]
    build = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir), "--output_dir", str(engine_dir),
             "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
             "--kv_cache_type", "paged", "--remove_input_padding", "enable", "--context_fmha", "enable",
             "--use_paged_context_fmha", "enable",
             "--max_batch_size", str(o.max_batch_size), "--max_num_tokens", str(o.max_num_tokens),
             "--max_input_len", str(plan.extra["max_input_len"]), "--max_seq_len", str(plan.extra["max_seq_len"]),
             "--max_beam_width", "1", "--multiple_profiles", "enable", "--workers", str(tp),
             "--tokens_per_block", str(TOKENS_PER_BLOCK)]
    if plan.dtype == "fp8":
        build += ["--use_fp8_context_fmha", "enable"]
    if plan.lora:
        build += ["--lora_plugin", "auto", "--lora_target_modules", *o.lora_target_modules,
                  "--max_lora_rank", str(o.max_lora_rank)]
    tok_dir = work_dir / "tokenizer"
    copy_tok = ["cp", "-L", *[f"{hf}/{n}" for n in TOKENIZER_FILES if (plan.ckpt.path / n).exists()], str(tok_dir)]
    values = trtllm_values(plan, serve_dir / "engine", serve_dir / "tokenizer", adapters_dir)
    return TrtllmPlan([convert, build, ["mkdir", "-p", str(tok_dir)], copy_tok], values, work_dir, engine_dir,
                      serve_dir / "engine", tok_dir)


def trtllm_values(plan: BuildPlan, engine_dir: Path, tokenizer_dir: Path, adapters_dir: Path) -> dict[str, str]:
    """${placeholders} of model_repository/trtllm/* (names follow tensorrtllm_backend's fill_template keys)."""
    o, tp = plan.opts, plan.tensor_parallel
    max_rank = o.max_lora_rank
    modules = len(o.lora_target_modules) * int(plan.ckpt.config.get("num_hidden_layers", 1))
    return {
        "triton_max_batch_size": str(o.max_batch_size), "decoupled_mode": "true",
        "max_queue_delay_microseconds": "0", "max_beam_width": "1",
        "batching_strategy": "inflight_fused_batching", "engine_dir": str(engine_dir),
        "batch_scheduler_policy": o.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": f"{o.kv_cache_free_gpu_mem_fraction:g}",
        "enable_kv_cache_reuse": str(o.enable_kv_cache_reuse).lower(), "enable_chunked_context": "true",
        "exclude_input_in_output": "true", "gpu_device_ids": ",".join(str(i) for i in range(tp)),
        "lora_cache_optimal_adapter_size": "8" if plan.lora else "0",
        "lora_cache_max_adapter_size": str(max_rank) if plan.lora else "0",
        "lora_cache_gpu_memory_fraction": "0.05" if plan.lora else "0",
        "lora_cache_host_memory_bytes": str(4 << 30) if plan.lora else "0",
        "lora_max_modules_layers": str(modules),
        "tokenizer_dir": str(tokenizer_dir), "adapters_dir": str(adapters_dir),
        "max_context": str(plan.max_context), "dtype": plan.dtype, "tensor_parallel": str(tp),
        "tokens_per_block": str(TOKENS_PER_BLOCK),
        "kv_cache_dtype": "fp8" if plan.opts.kv_cache_dtype == "fp8" else HF_DTYPE[plan.dtype],
    }


def render(values: dict[str, str], out_dir: Path, templates: dict[str, Path] | None = None) -> Path:
    """Render the GPU Triton repository (ensemble llm, preprocessing, tensorrt_llm, postprocessing)."""
    return triton_repo.render_steps(out_dir, values, templates or GPU_TEMPLATES)


def convert_adapters(adapters_dir: Path) -> list[str]:
    """PEFT adapters under adapters_dir -> model.lora_{weights,config}.npy beside them; returns their names."""
    from build_engines.lora_convert import convert_peft

    done = []
    for folder in sorted(p for p in adapters_dir.glob("*") if (p / "adapter_config.json").is_file()):
        convert_peft(folder, folder)
        done.append(folder.name)
    return done


def runtime_problems(tp: int, examples_dir: str) -> list[str]:
    """Why this machine cannot run the real build (empty when it can)."""
    problems = []
    if shutil.which("trtllm-build") is None:
        problems.append("`trtllm-build` is not on PATH (TensorRT-LLM is not installed)")
    if not Path(examples_dir, "quantization", "quantize.py").is_file():
        problems.append(f"TensorRT-LLM examples not found at {examples_dir} (set --trtllm-examples / "
                        "TRTLLM_EXAMPLES_DIR)")
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.count("GPU ")
    except (OSError, subprocess.SubprocessError):
        gpus = 0
    if gpus < tp:
        problems.append(f"{gpus} GPU(s) visible, tensor parallel {tp} needs {tp}")
    return problems


def _run(cmd: list[str], log: Path, label: str) -> float:
    t = time.perf_counter()
    with log.open("a") as fh, stage.console.status(f"{label}: {shlex.join(cmd)[:120]}"):
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{label} exited {proc.returncode}; last output:\n{tail}")
    return time.perf_counter() - t


def build_trtllm(opts: BuildOptions, settings: Settings, db_url: str, gate: GateOptions | None = None) -> BuildResult:
    """Validate, then either print the plan (--dry-run) or run it, stage it and register it."""
    if precheck_checkpoint(opts.checkpoint)[0].is_file():
        raise BuildError("--checkpoint", "the trtllm target needs a Hugging Face folder (safetensors); GGUF "
                                         "checkpoints are only taken by the cpu target")
    ckpt = inspect_checkpoint(opts.checkpoint)
    plan = resolve(opts, ckpt)
    vdir = version_dir(settings, opts.model, opts.version)
    work = settings.data_dir / "build" / f"{opts.model}-{opts.version}"
    examples = opts.trtllm_examples or settings.trtllm_examples_dir
    tp_plan = plan_trtllm(plan, work, vdir, settings.data_dir / "adapters", examples)
    uri = store_uri(settings, opts)
    if opts.dry_run:
        tmp = settings.data_dir / "build" / f".dry-run-{uuid.uuid4().hex[:8]}"
        try:
            render(tp_plan.values, tmp / "model_repository")
            cfg = (tmp / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        text = (f"# target trtllm (TensorRT-LLM {TRTLLM_VERSION}; run inside {TRITON_IMAGE})\n"
                f"# {opts.model} version {opts.version}: dtype {plan.dtype}, tensor parallel {plan.tensor_parallel}, "
                f"LoRA plugin {'on' if plan.lora else 'off'}, max context {plan.max_context}\n"
                f"{tp_plan.shell()}\n"
                + (f"# convert PEFT adapters under {settings.data_dir / 'adapters'} to TensorRT-LLM LoRA tensors\n"
                   if plan.lora else "")
                + f"# then: render {vdir}/model_repository, stage to {uri}, register "
                f"building -> built -> staged\n# --- tensorrt_llm/config.pbtxt ---\n{cfg}")
        return BuildResult("planned", opts.model, opts.version, message="dry run: nothing done", plan_text=text)
    problems = runtime_problems(plan.tensor_parallel, examples)
    if problems:
        raise BuildError("--target", "cannot run the TensorRT-LLM build here: " + "; ".join(problems) +
                         f". Run it on a GPU node inside {TRITON_IMAGE} (docs/build_engines.md), or use --dry-run")
    with stage.file_lock(vdir.with_name(f".{opts.version}.lock"), blocking=False) as held:
        if not held:
            raise BuildError("--version", f"another build-engines is building {opts.model} version "
                                          f"{opts.version} right now; wait for it to finish")
        return _run_build(opts, settings, db_url, ckpt, plan, vdir, work, tp_plan, uri)


def _run_build(opts: BuildOptions, settings: Settings, db_url: str, ckpt: Any, plan: BuildPlan, vdir: Path,
               work: Path, tp_plan: TrtllmPlan, uri: str) -> BuildResult:
    """The real TensorRT-LLM build (GPU node), under the version's lock."""
    clean_stale_partials(vdir, uri)
    sha = stage.checkpoint_sha256(ckpt.path, settings.cache_dir / "checksums.json")
    fields = plan.fingerprint_fields(sha)
    fingerprint = inputs_fingerprint(fields)
    reg = Registration(db_url, opts.model, opts.version)
    existing = check_existing(db_url, opts.model, opts.version, fingerprint, opts.force,
                              artefacts_ok(settings, opts.model, opts.version, uri))
    if existing.decision == "noop":
        return BuildResult("noop", opts.model, opts.version, read_row(db_url, opts.model, opts.version),
                           f"{opts.model} version {opts.version} is already built from the same inputs")
    timings: dict[str, float] = {}
    info: dict[str, Any] = {"tool": "build-engines trtllm", "trtllm_version": TRTLLM_VERSION, "inputs": fields,
                            "inputs_sha256": fingerprint, "commands": [shlex.join(c) for c in tp_plan.commands],
                            "options": opts.model_dump(mode="json"), "timings_s": timings,
                            "started_at": datetime.now(timezone.utc).isoformat()}
    reg.begin(weights_uri=uri, dtype=plan.dtype, tensor_parallel=plan.tensor_parallel,
              max_context=plan.max_context, engine_kind="trtllm", repository_path="", build_info=info)
    partial = vdir.with_name(f".{opts.version}.partial-{uuid.uuid4().hex[:8]}")
    step = "prepare"
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for i, cmd in enumerate(tp_plan.commands):
            step = f"step {i + 1}/{len(tp_plan.commands)} ({Path(cmd[1] if cmd[0] == 'python3' else cmd[0]).name})"
            timings[step] = _run(cmd, work / "build.log", step)
        if plan.lora:
            step = "convert LoRA adapters"
            info["lora_converted"] = convert_adapters(settings.data_dir / "adapters")
        step = "collect artefacts"
        partial.mkdir(parents=True)
        shutil.move(str(tp_plan.engine_dir), partial / "engine")
        shutil.move(str(tp_plan.tokenizer_dir), partial / "tokenizer")
        render(tp_plan.values, partial / "model_repository")
        manifest = stage.manifest_of(partial, "engine")
        info.update(files=manifest, weights_sha256=stage.tree_digest(manifest))
        reg.update("built", build_info=info)
        step = "stage to weights store"
        stage.stage_to_store(partial, uri, manifest)
        (partial / stage.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        stage.replace_dir(partial, vdir)
        info["finished_at"] = datetime.now(timezone.utc).isoformat()
        reg.update("staged", repository_path=str(vdir / "model_repository"), weights_uri=uri, build_info=info)
    except BaseException as exc:
        reg.fail(f"{type(exc).__name__} during {step}: {exc}", info)
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, BuildError):
            raise BuildError(step, f"{type(exc).__name__}: {exc}") from exc
        raise
    return BuildResult("built", opts.model, opts.version, read_row(db_url, opts.model, opts.version),
                       f"{opts.model} version {opts.version} (trtllm) staged")
