"""Target `trtllm`: the TensorRT-LLM engine build for GPU nodes, and the Triton repository that serves it.

Written against TensorRT-LLM 0.17 (tensorrtllm_backend v0.17.0), whose tools ship in NVIDIA's Triton
TRT-LLM container (nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3, deploy/docker/Dockerfile.gpu) with the
TensorRT-LLM examples mounted at --trtllm-examples (see docs/build_engines.md). The steps, in order:

1. checkpoint, chosen from the checkpoint's architecture (CONVERTERS): fp16/bf16 through
   `examples/<llama|qwen|gemma|phi>/convert_checkpoint.py` in the checkpoint's own dtype; fp8 weights and/or an
   fp8 KV cache through `examples/quantization/quantize.py` (ModelOpt), calibrated on a local dataset
   (`--calib-dataset`, default the shipped build_engines/calib: an air-gapped node downloads nothing);
2. engine: `trtllm-build` with paged KV cache, paged context FMHA (KV-cache reuse, chunked context; fp8 weights
   add fp8 context FMHA with their fp8 KV cache, NVIDIA's recipe), removed input padding, the gemm/attention
   plugins, the LoRA plugin for the small base model, and max batch size / num tokens / lengths;
3. quality gate (build_engines.trtllm_gate): a small second engine from the same checkpoint that returns context
   logits, scored by TensorRT-LLM's ModelRunner against the checkpoint's transformers fp32 run;
4. LoRA engines: every PEFT adapter under the adapters folder converted to TensorRT-LLM's LoRA tensors
   (build_engines.lora_convert, the layout of TensorRT-LLM's hf_lora_convert.py) beside its PEFT files;
5. tokenizer files copied next to the engine; the Triton repository rendered with the `tensorrt_llm`
   model (inflight fused batching, decoupled streaming, kv_cache_free_gpu_mem_fraction, KV-cache reuse,
   LoRA cache) and the GPU preprocessing / postprocessing; then staged and registered like the cpu target
   (`failed` with the report when the gate fails).

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
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.gpu_info import query_gpus
from common.settings import REPO_ROOT, Settings

from build_engines import stage, triton_repo, xgrammar_info
from build_engines.layout import BuildResult, artefacts_ok, clean_stale_partials, store_uri, version_dir
from build_engines.plan import (BuildError, BuildOptions, BuildPlan, inputs_fingerprint, inspect_checkpoint,
                                precheck_checkpoint, resolve)
from build_engines.quality_gate import GateOptions, skipped_report, summary
from build_engines.register import Registration, check_existing, read_row

TRTLLM_VERSION = "0.17.0"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3"
TEMPLATES = REPO_ROOT / "model_repository"
GPU_TEMPLATES = {"llm": TEMPLATES / "gpu" / "llm", "preprocessing": TEMPLATES / "gpu" / "preprocessing",
                 "tensorrt_llm": TEMPLATES / "tensorrt_llm", "postprocessing": TEMPLATES / "gpu" / "postprocessing"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "config.json", "chat_template.jinja")
HF_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}
TOKENS_PER_BLOCK = 64  # KV-cache block size given to trtllm-build; postprocessing turns reused blocks into tokens
CALIB_DIR = Path(__file__).with_name("calib")  # shipped calibration set (train.jsonl, `text`): no download
# checkpoint architecture -> TensorRT-LLM 0.17 examples/<family>/convert_checkpoint.py (docs/build_engines.md cites
# the sources). Mistral goes through the Llama converter, as TensorRT-LLM's own Llama example does.
CONVERTERS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen",
              "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma", "Phi3ForCausalLM": "phi",
              "PhiForCausalLM": "phi"}
LATER_THAN_PIN = {"Qwen3ForCausalLM": "Qwen3", "Gemma3ForCausalLM": "Gemma 3",
                  "Gemma3ForConditionalGeneration": "Gemma 3"}


@dataclass(frozen=True)
class TrtllmPlan:
    """The exact commands and Triton config values of one TensorRT-LLM build."""
    commands: list[list[str]]
    values: dict[str, str]
    work_dir: Path
    engine_dir: Path      # where the engine is built (inside work_dir)
    serve_engine_dir: Path  # where replicas read it (node-local cache)
    tokenizer_dir: Path
    notes: tuple[str, ...] = ()
    gate_report: Path | None = None  # written by the gate step (build_engines.trtllm_gate)

    def shell(self) -> str:
        return "\n".join(shlex.join(c) for c in self.commands)


def family_of(plan: BuildPlan) -> str:
    """The converter family of the checkpoint's architecture, or a BuildError naming what is supported."""
    arch = (plan.ckpt.config.get("architectures") or [plan.ckpt.config.get("architecture", "")])[0]
    if arch in CONVERTERS:
        return CONVERTERS[arch]
    later = f" ({LATER_THAN_PIN[arch]} converters arrived after TensorRT-LLM {TRTLLM_VERSION}, the version the GPU " \
            "image pins; serve it with --target cpu or move the pin)" if arch in LATER_THAN_PIN else ""
    raise BuildError("--checkpoint", f"architecture {arch or 'missing'!r} has no TensorRT-LLM {TRTLLM_VERSION} "
                                     f"converter{later}; supported: {sorted(CONVERTERS)}")


def kept_dtype(plan: BuildPlan) -> str:
    """The TensorRT-LLM dtype of the unquantised parts: --dtype fp16|bf16 as asked; for fp8 (or no --dtype) the
    checkpoint's own (a bf16 checkpoint stays bf16; fp32 becomes float16, as TensorRT-LLM's infer_dtype does)."""
    if plan.opts.dtype in HF_DTYPE:
        return HF_DTYPE[plan.opts.dtype]
    return "bfloat16" if plan.ckpt.config.get("torch_dtype") == "bfloat16" else "float16"


def effective_plan(plan: BuildPlan) -> BuildPlan:
    """The plan with the dtype the engine really gets (fp8, or the kept fp16/bf16) as the registry records it."""
    if plan.dtype == "fp8":
        return plan
    return replace(plan, dtype={"bfloat16": "bf16", "float16": "fp16"}[kept_dtype(plan)])


def convert_command(family: str, examples_dir: str, hf: str, dtype: str, tp: int, out: Path) -> list[str]:
    """examples/<family>/convert_checkpoint.py with that script's own flag names (Gemma's use dashes)."""
    script = f"{examples_dir}/{family}/convert_checkpoint.py"
    if family == "gemma":
        return ["python3", script, "--ckpt-type", "hf", "--model-dir", hf, "--dtype", dtype, "--world-size", str(tp),
                "--output-model-dir", str(out)]
    return ["python3", script, "--model_dir", hf, "--dtype", dtype, "--tp_size", str(tp), "--pp_size", "1",
            "--workers", str(tp), "--output_dir", str(out)]


def plan_trtllm(plan: BuildPlan, work_dir: Path, serve_dir: Path, adapters_dir: Path,
                examples_dir: str, calib_dataset: str | None = None, gate: GateOptions | None = None) -> TrtllmPlan:
    """Commands + config values; paths: work_dir (build scratch), serve_dir (the version's node-local folder).

    fp8 follows NVIDIA's recipe: ModelOpt fp8 weights with an fp8 KV cache and fp8 context FMHA, together.
    fp16/bf16 weights with an fp8 KV cache: no paged context FMHA (TensorRT-LLM 0.17 has no paged context FMHA
    over an fp8 cache without fp8 context FMHA, which needs fp8 weights), hence no KV-cache reuse or chunked
    context on that engine (said in the plan's notes)."""
    o, tp = plan.opts, plan.tensor_parallel
    family = family_of(plan)
    hf = str(plan.ckpt.path)
    ckpt_dir, engine_dir = work_dir / "trtllm_checkpoint", work_dir / "engine"
    base_dtype = kept_dtype(plan)
    fp8 = plan.dtype == "fp8"
    kv_fp8 = fp8 or o.kv_cache_dtype == "fp8"
    notes: list[str] = []
    if kv_fp8:  # ModelOpt: fp8 weights and/or fp8 KV-cache scales need calibration, on a local dataset
        convert = ["python3", f"{examples_dir}/quantization/quantize.py", "--model_dir", hf,
                   "--dtype", base_dtype, "--qformat", "fp8" if fp8 else "full_prec", "--kv_cache_dtype", "fp8",
                   "--calib_dataset", calib_dataset or str(CALIB_DIR), "--calib_size", str(o.calib_size),
                   "--tp_size", str(tp), "--pp_size", "1", "--output_dir", str(ckpt_dir)]
    else:
        convert = convert_command(family, examples_dir, hf, base_dtype, tp, ckpt_dir)
    paged_context = fp8 or not kv_fp8
    if not paged_context:
        notes.append(f"{base_dtype} weights with an fp8 KV cache: paged context FMHA off, so KV-cache reuse and "
                     "chunked context are off on this engine (use --dtype fp8 for both, or an auto KV cache)")
    build = ["trtllm-build", "--checkpoint_dir", str(ckpt_dir), "--output_dir", str(engine_dir),
             "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
             "--kv_cache_type", "paged", "--remove_input_padding", "enable", "--context_fmha", "enable",
             "--use_paged_context_fmha", "enable" if paged_context else "disable",
             "--max_batch_size", str(o.max_batch_size), "--max_num_tokens", str(o.max_num_tokens),
             "--max_input_len", str(plan.extra["max_input_len"]), "--max_seq_len", str(plan.extra["max_seq_len"]),
             "--max_beam_width", "1", "--multiple_profiles", "enable", "--workers", str(tp),
             "--tokens_per_block", str(TOKENS_PER_BLOCK)]
    if fp8:
        build += ["--use_fp8_context_fmha", "enable"]
    if plan.lora:
        build += ["--lora_plugin", "auto", "--lora_target_modules", *o.lora_target_modules,
                  "--max_lora_rank", str(o.max_lora_rank)]
    tok_dir = work_dir / "tokenizer"
    copy_tok = ["cp", "-L", *[f"{hf}/{n}" for n in TOKENIZER_FILES if (plan.ckpt.path / n).exists()], str(tok_dir)]
    values = trtllm_values(plan, serve_dir / "engine", serve_dir / "tokenizer", adapters_dir)
    if not paged_context:
        values.update(enable_kv_cache_reuse="false", enable_chunked_context="false")
    commands = [convert, build, ["mkdir", "-p", str(tok_dir)], copy_tok]
    report = None
    if gate is not None and not gate.skip_reason:
        from build_engines.trtllm_gate import gate_commands
        gate_cmds, report = gate_commands(build, ckpt_dir, work_dir, hf, plan.dtype, tp, gate)
        commands += gate_cmds
    return TrtllmPlan(commands, values, work_dir, engine_dir, serve_dir / "engine", tok_dir, tuple(notes), report)


GUIDED_DECODING_SINCE = (0, 19)


def guided_decoding_supported(version: str) -> bool:
    """Whether tensorrtllm_backend `version` applies the guided_decoding_guide inputs (0.19 and later)."""
    return tuple(int(x) for x in version.split(".")[:2]) >= GUIDED_DECODING_SINCE


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
        # TensorRT-LLM guided decoding (tensorrtllm_backend >= 0.19 reads these; docs/gpu_path.md). On an older
        # backend the guide inputs are declared but ignored: the output would be unconstrained, so the GPU
        # preprocessing refuses response_format there (`guided_decoding` off) instead of serving it unchecked.
        "guided_decoding": "on" if guided_decoding_supported(TRTLLM_VERSION) else "off",
        "guided_decoding_backend": "xgrammar",
        "xgrammar_tokenizer_info_path": str(Path(tokenizer_dir) / "xgrammar_tokenizer_info.json"),
        "max_context": str(plan.max_context), "dtype": plan.dtype, "tensor_parallel": str(tp),
        "tokens_per_block": str(TOKENS_PER_BLOCK),
        "kv_cache_dtype": "fp8" if plan.dtype == "fp8" or plan.opts.kv_cache_dtype == "fp8" else HF_DTYPE[plan.dtype],
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


def build_trtllm(opts: BuildOptions, settings: Settings, db_url: str, gate: GateOptions | None = None,
                 calib_dataset: str | None = None) -> BuildResult:
    """Validate, then either print the plan (--dry-run) or run it, stage it and register it."""
    gate = gate or GateOptions()
    if precheck_checkpoint(opts.checkpoint)[0].is_file():
        raise BuildError("--checkpoint", "the trtllm target needs a Hugging Face folder (safetensors); GGUF "
                                         "checkpoints are only taken by the cpu target")
    ckpt = inspect_checkpoint(opts.checkpoint)
    plan = effective_plan(resolve(opts, ckpt))
    vdir = version_dir(settings, opts.model, opts.version)
    work = settings.data_dir / "build" / f"{opts.model}-{opts.version}"
    examples = opts.trtllm_examples or settings.trtllm_examples_dir
    tp_plan = plan_trtllm(plan, work, vdir, settings.data_dir / "adapters", examples, calib_dataset, gate)
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
                f"LoRA plugin {'on' if plan.lora else 'off'}, max context {plan.max_context}, converter "
                f"{family_of(plan)}\n" + "".join(f"# note: {n}\n" for n in tp_plan.notes)
                + (f"# quality gate skipped: {gate.skip_reason}\n" if gate.skip_reason else "")
                + f"{tp_plan.shell()}\n"
                + (f"# convert PEFT adapters under {settings.data_dir / 'adapters'} to TensorRT-LLM LoRA tensors\n"
                   if plan.lora else "")
                + f"# then: render {vdir}/model_repository, stage to {uri}, register "
                f"building -> built -> staged\n# --- tensorrt_llm/config.pbtxt ---\n{cfg}")
        return BuildResult("planned", opts.model, opts.version, message="dry run: nothing done", plan_text=text)
    problems = runtime_problems(plan.tensor_parallel, examples)
    calib = calib_dataset or str(CALIB_DIR)
    if tp_plan.commands[0][1].endswith("quantize.py") and not Path(calib).is_dir():
        problems.append(f"--calib-dataset {calib} is not a local folder (ModelOpt reads its `train` split, "
                        "`text` column; the GPU node downloads nothing)")
    if problems:
        raise BuildError("--target", "cannot run the TensorRT-LLM build here: " + "; ".join(problems) +
                         f". Run it on a GPU node inside {TRITON_IMAGE} (docs/build_engines.md), or use --dry-run")
    with stage.file_lock(vdir.with_name(f".{opts.version}.lock"), blocking=False) as held:
        if not held:
            raise BuildError("--version", f"another build-engines is building {opts.model} version "
                                          f"{opts.version} right now; wait for it to finish")
        return _run_build(opts, settings, db_url, ckpt, plan, vdir, work, tp_plan, uri, gate)


def _run_build(opts: BuildOptions, settings: Settings, db_url: str, ckpt: Any, plan: BuildPlan, vdir: Path,
               work: Path, tp_plan: TrtllmPlan, uri: str, gate: GateOptions) -> BuildResult:
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
                            "started_at": datetime.now(timezone.utc).isoformat(),
                            # the engine runs only on this GPU model: the actuator pins the pool's nodes to it
                            "gpu": query_gpus()}
    reg.begin(weights_uri=uri, dtype=plan.dtype, tensor_parallel=plan.tensor_parallel,
              max_context=plan.max_context, engine_kind="trtllm", repository_path="", build_info=info)
    partial = vdir.with_name(f".{opts.version}.partial-{uuid.uuid4().hex[:8]}")
    step = "prepare"
    report: dict[str, Any] = skipped_report(gate.skip_reason) if gate.skip_reason else {}
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for i, cmd in enumerate(tp_plan.commands):
            step = f"step {i + 1}/{len(tp_plan.commands)} ({Path(cmd[1] if cmd[0] == 'python3' else cmd[0]).name})"
            timings[step] = _run(cmd, work / "build.log", step)
        if tp_plan.gate_report is not None:
            step = "quality gate"
            report = json.loads(tp_plan.gate_report.read_text())
            stage.console.print(summary(report), highlight=False)
            if not report["passed"]:
                raise RuntimeError(summary(report))
        step = "guided decoding tokenizer file"  # beside the served tokenizer (values xgrammar_tokenizer_info_path)
        xgrammar_info.write(plan.ckpt.path, tp_plan.tokenizer_dir)
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
        reg.update("staged", repository_path=str(vdir / "model_repository"), weights_uri=uri, build_info=info,
                   quality_gate=report)
    except BaseException as exc:
        reg.fail(f"{type(exc).__name__} during {step}: {exc}", info, **({"quality_gate": report} if report else {}))
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, BuildError):
            raise BuildError(step, f"{type(exc).__name__}: {exc}") from exc
        raise
    return BuildResult("built", opts.model, opts.version, read_row(db_url, opts.model, opts.version),
                       f"{opts.model} version {opts.version} (trtllm) staged")
