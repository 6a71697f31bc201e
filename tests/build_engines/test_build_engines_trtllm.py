"""build-engines, target trtllm: the generated Triton configs parse with Triton's model config protobuf and hold
the fp8 / TP 4 / paged KV / inflight batching settings; the planned commands parse against the TensorRT-LLM
CLI's documented arguments. TensorRT-LLM itself is not installed here (and is not faked): only plans run."""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engines import trtllm
from build_engines.build import build
from build_engines.plan import BuildError, inspect_checkpoint, parse_options, resolve
from build_engines.triton_repo import TEMPLATES
from common.settings import Settings

SPEC = json.loads((Path(__file__).parent / "trtllm_cli_spec.json").read_text())


def parse_config(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def params(cfg: model_config_pb2.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def documented_parser(tool: str) -> argparse.ArgumentParser:
    """An argparse parser holding exactly the documented arguments (and choices) of one TensorRT-LLM tool."""
    spec = SPEC[tool]
    p = argparse.ArgumentParser(prog=tool, exit_on_error=False)
    for name in spec["value"]:
        p.add_argument(f"--{name}")
    for name in spec["flag"]:
        p.add_argument(f"--{name}", action="store_true")
    for name, choices in spec["choice"].items():
        p.add_argument(f"--{name}", choices=choices)
    for name, choices in spec["multi"].items():
        p.add_argument(f"--{name}", nargs="+", choices=choices)
    return p


def check_against_cli(cmd: list[str]) -> argparse.Namespace:
    tool = {"trtllm-build": "trtllm-build"}.get(cmd[0]) or Path(cmd[1]).name
    args = cmd[1:] if cmd[0] == "trtllm-build" else cmd[2:]
    parser = documented_parser(tool)
    ns, unknown = parser.parse_known_args(args)
    assert not unknown, f"{tool}: arguments not in the documented CLI: {unknown}"
    return ns


def plan_for(ckpt: Path, tmp_path: Path, **kw) -> trtllm.TrtllmPlan:
    opts = parse_options(model="m", version="1", checkpoint=str(ckpt), target="trtllm", **kw)
    plan = resolve(opts, inspect_checkpoint(str(ckpt)))
    return trtllm.plan_trtllm(plan, tmp_path / "work", tmp_path / "serve", tmp_path / "adapters",
                               "/opt/TensorRT-LLM/examples")


def test_large_model_fp8_tp4_plan_matches_documented_cli(llama70b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama70b_dir, tmp_path, dtype="fp8", kv_cache_dtype="fp8", max_context=8192)
    quantize, engine = p.commands[0], p.commands[1]
    q = check_against_cli(quantize)
    assert Path(quantize[1]).name == "quantize.py"
    assert (q.qformat, q.kv_cache_dtype, q.tp_size, q.dtype) == ("fp8", "fp8", "4", "float16")  # TP 4 by default
    b = check_against_cli(engine)
    assert b.kv_cache_type == "paged" and b.use_paged_context_fmha == "enable"
    assert b.use_fp8_context_fmha == "enable" and b.remove_input_padding == "enable"
    assert b.gemm_plugin == "auto" and b.gpt_attention_plugin == "auto"
    assert (b.max_batch_size, b.max_num_tokens, b.max_input_len, b.max_seq_len) == ("64", "8192", "8191", "8192")
    assert b.lora_plugin is None  # the large model carries no adapters
    assert b.workers == "4" and b.checkpoint_dir == q.output_dir


def test_context_defaults_to_the_checkpoint_and_fp8_kv_cache_is_its_own_choice(llama70b_dir: Path,
                                                                             llama8b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama70b_dir, tmp_path, dtype="fp8")  # no --max-context: the checkpoint's 131072
    b = check_against_cli(p.commands[1])
    assert (b.max_input_len, b.max_seq_len) == ("131071", "131072") and p.values["max_context"] == "131072"
    q = check_against_cli(p.commands[0])
    assert q.qformat == "fp8" and q.kv_cache_dtype is None  # fp8 weights do not force an fp8 KV cache
    assert "KV cache float16" in trtllm.render(p.values, tmp_path / "r1").joinpath(
        "tensorrt_llm", "config.pbtxt").read_text()
    p16 = plan_for(llama8b_dir, tmp_path, kv_cache_dtype="fp8", max_context=4096)  # fp16 weights, fp8 KV
    q16 = check_against_cli(p16.commands[0])
    assert Path(p16.commands[0][1]).name == "quantize.py"
    assert (q16.qformat, q16.kv_cache_dtype) == ("full_prec", "fp8")
    assert check_against_cli(p16.commands[1]).use_fp8_context_fmha is None  # needs fp8 weights
    assert int(check_against_cli(p16.commands[1]).tokens_per_block) == trtllm.TOKENS_PER_BLOCK


def test_small_model_fp16_with_lora_plugin(llama8b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama8b_dir, tmp_path, max_context=4096, max_lora_rank=32)
    conv = check_against_cli(p.commands[0])
    assert Path(p.commands[0][1]).name == "convert_checkpoint.py"
    assert conv.dtype == "float16" and conv.tp_size == "1"
    b = check_against_cli(p.commands[1])
    assert b.lora_plugin == "auto" and b.max_lora_rank == "32"
    assert b.lora_target_modules == ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h",
                                     "mlp_gate"]
    assert b.use_fp8_context_fmha is None and b.kv_cache_type == "paged"


def test_rendered_gpu_repository_parses_and_holds_the_settings(llama70b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama70b_dir, tmp_path, dtype="fp8", kv_cache_dtype="fp8", kv_cache_free_gpu_mem_fraction=0.85)
    repo = trtllm.render(p.values, tmp_path / "repo")
    cfgs = {step: parse_config(repo / step / "config.pbtxt") for step in trtllm.GPU_TEMPLATES}
    t = cfgs["tensorrt_llm"]
    assert t.backend == "tensorrtllm" and t.max_batch_size == 64
    assert t.model_transaction_policy.decoupled
    tp = params(t)
    assert tp["gpt_model_type"] == "inflight_fused_batching"
    assert tp["gpt_model_path"] == str(tmp_path / "serve" / "engine")
    assert tp["kv_cache_free_gpu_mem_fraction"] == "0.85" and tp["enable_kv_cache_reuse"] == "true"
    assert tp["batch_scheduler_policy"] == "guaranteed_no_evict" and tp["gpu_device_ids"] == "0,1,2,3"
    assert tp["enable_chunked_context"] == "true" and tp["exclude_input_in_output"] == "true"
    assert "fp8 weights, KV cache fp8, tensor parallel 4" in (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    for step in trtllm.GPU_TEMPLATES:
        assert (repo / step / "1").is_dir()
    # Every tensor the ensemble feeds a step exists on that step, with the same data type.
    ens = cfgs["llm"]
    produced = {i.name: i.data_type for i in ens.input}
    for st in ens.ensemble_scheduling.step:
        model = cfgs[st.model_name]
        inputs = {i.name: i.data_type for i in model.input}
        for key, value in st.input_map.items():
            assert key in inputs, (st.model_name, key)
            assert produced[value] == inputs[key], (st.model_name, key)
        outputs = {o.name: o.data_type for o in model.output}
        for key, value in st.output_map.items():
            assert key in outputs, (st.model_name, key)
            produced[value] = outputs[key]


def test_gpu_ensemble_has_the_cpu_ensembles_outside_shape() -> None:
    cpu = parse_config(TEMPLATES / "llm" / "config.pbtxt")
    gpu = parse_config(TEMPLATES / "gpu" / "llm" / "config.pbtxt")
    shape = lambda ts: [text_format.MessageToString(t, as_one_line=True) for t in ts]  # noqa: E731
    assert shape(cpu.input) == shape(gpu.input) and shape(cpu.output) == shape(gpu.output)
    assert cpu.max_batch_size == gpu.max_batch_size == 0 and gpu.platform == "ensemble"


def test_rendered_cpu_repository_parses(tmp_path: Path) -> None:
    from build_engines.triton_repo import cpu_values, render_repository
    repo = render_repository(tmp_path / "repo", cpu_values(tmp_path / "w", tmp_path / "a", 2048))
    for step in ("llm", "preprocessing", "engine", "postprocessing"):
        parse_config(repo / step / "config.pbtxt")


def test_dry_run_prints_steps_and_config_and_touches_nothing(be_settings: Settings, sqlite_url: str,
                                                             llama70b_dir: Path) -> None:
    result = build(parse_options(model="llama-70b", version="1", checkpoint=str(llama70b_dir), target="trtllm",
                                 dtype="fp8", dry_run=True), be_settings, sqlite_url)
    assert result.outcome == "planned"
    lines = result.plan_text.splitlines()
    assert any(line.startswith("trtllm-build ") for line in lines)
    for line in lines:
        if line.startswith(("trtllm-build ", "python3 ")):
            check_against_cli(shlex.split(line))
    cfg_text = result.plan_text.split("# --- tensorrt_llm/config.pbtxt ---\n", 1)[1]
    cfg = text_format.Parse(cfg_text, model_config_pb2.ModelConfig())
    assert params(cfg)["gpt_model_type"] == "inflight_fused_batching"
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()
    assert not be_settings.engines_dir.exists()


def test_real_trtllm_build_refuses_to_start_without_tensorrt_llm(be_settings: Settings, sqlite_url: str,
                                                                llama70b_dir: Path) -> None:
    with pytest.raises(BuildError, match="cannot run the TensorRT-LLM build here") as err:
        build(parse_options(model="llama-70b", version="1", checkpoint=str(llama70b_dir), target="trtllm",
                            dtype="fp8"), be_settings, sqlite_url)
    assert "trtllm-python-py3" in str(err.value) and err.value.field == "--target"
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


def test_trtllm_bad_inputs(llama70b_dir: Path, tmp_path: Path, be_settings: Settings, sqlite_url: str) -> None:
    with pytest.raises(BuildError, match="--tensor-parallel: 3 does not divide the model's 64 attention heads"):
        plan_for(llama70b_dir, tmp_path, tensor_parallel=3)
    with pytest.raises(BuildError, match="allowed: \\['fp16', 'bf16', 'fp8'\\]"):
        plan_for(llama70b_dir, tmp_path, dtype="int4")
    with pytest.raises(BuildError, match="--max-input-len"):
        plan_for(llama70b_dir, tmp_path, max_seq_len=4096, max_input_len=4096)
    with pytest.raises(BuildError, match="GGUF checkpoints are only taken by the cpu target"):
        build(parse_options(model="m", version="1", checkpoint="smollm2", target="trtllm", dry_run=True),
              be_settings, sqlite_url)


def test_cli_dry_run(llama70b_dir: Path, be_settings: Settings) -> None:
    out = subprocess.run([sys.executable, "-m", "build_engines.cli", "--model", "llama-70b", "--version", "4",
                          "--checkpoint", str(llama70b_dir), "--target", "trtllm", "--dtype", "fp8",
                          "--kv-cache-dtype", "fp8", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--qformat fp8 --kv_cache_dtype fp8" in out.stdout and "--tp_size 4" in out.stdout
