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

from build_engines import trtllm, trtllm_gate
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
    p = argparse.ArgumentParser(prog=tool, exit_on_error=False, allow_abbrev=False)
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
    if cmd[0] == "mpirun":  # mpirun --allow-run-as-root -n N <command>
        cmd = cmd[cmd.index("-n") + 2:]
    if cmd[:3] == ["python3", "-m", "build_engines.trtllm_gate"]:  # our own gate step: its own parser
        return trtllm_gate.parser().parse_args(cmd[3:])
    family_tool = "/".join(Path(cmd[1]).parts[-2:]) if cmd[0] == "python3" else ""
    tool = "trtllm-build" if cmd[0] == "trtllm-build" else family_tool if family_tool in SPEC else Path(cmd[1]).name
    args = cmd[1:] if cmd[0] == "trtllm-build" else cmd[2:]
    parser = documented_parser(tool)
    ns, unknown = parser.parse_known_args(args)
    assert not unknown, f"{tool}: arguments not in the documented CLI: {unknown}"
    return ns


def plan_for(ckpt: Path, tmp_path: Path, **kw) -> trtllm.TrtllmPlan:
    opts = parse_options(model="m", version="1", checkpoint=str(ckpt), target="trtllm", **kw)
    plan = trtllm.effective_plan(resolve(opts, inspect_checkpoint(str(ckpt))))
    return trtllm.plan_trtllm(plan, tmp_path / "work", tmp_path / "serve", tmp_path / "adapters",
                               "/opt/TensorRT-LLM/examples")


def test_large_model_fp8_tp4_plan_matches_documented_cli(llama70b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama70b_dir, tmp_path, dtype="fp8", kv_cache_dtype="fp8", max_context=8192)
    quantize, engine = p.commands[0], p.commands[1]
    q = check_against_cli(quantize)
    assert Path(quantize[1]).name == "quantize.py"
    # TP 4 by default; the bf16 checkpoint's unquantised parts stay bf16; calibration on the shipped local set
    assert (q.qformat, q.kv_cache_dtype, q.tp_size, q.dtype) == ("fp8", "fp8", "4", "bfloat16")
    assert q.calib_dataset == str(trtllm.CALIB_DIR) and (trtllm.CALIB_DIR / "train.jsonl").is_file()
    b = check_against_cli(engine)
    assert b.kv_cache_type == "paged" and b.use_paged_context_fmha == "enable"
    assert b.use_fp8_context_fmha == "enable" and b.remove_input_padding == "enable"
    assert b.gemm_plugin == "auto" and b.gpt_attention_plugin == "auto"
    assert (b.max_batch_size, b.max_num_tokens, b.max_input_len, b.max_seq_len) == ("64", "8192", "8191", "8192")
    assert b.lora_plugin is None  # the large model carries no adapters
    assert b.workers == "4" and b.checkpoint_dir == q.output_dir


def test_fp8_recipes_match_nvidias(llama70b_dir: Path, llama8b_dir: Path, tmp_path: Path) -> None:
    """fp8 weights always come with an fp8 KV cache and fp8 context FMHA (NVIDIA's recipe); fp16/bf16 weights
    with an fp8 KV cache get no paged context FMHA, hence no KV-cache reuse / chunked context, said in the plan."""
    p = plan_for(llama70b_dir, tmp_path, dtype="fp8")  # no --max-context: the checkpoint's 131072
    b = check_against_cli(p.commands[1])
    assert (b.max_input_len, b.max_seq_len) == ("131071", "131072") and p.values["max_context"] == "131072"
    q = check_against_cli(p.commands[0])
    assert (q.qformat, q.kv_cache_dtype) == ("fp8", "fp8") and b.use_fp8_context_fmha == "enable"
    assert b.use_paged_context_fmha == "enable" and p.values["enable_kv_cache_reuse"] == "true"
    assert "KV cache fp8" in trtllm.render(p.values, tmp_path / "r1").joinpath(
        "tensorrt_llm", "config.pbtxt").read_text()
    p16 = plan_for(llama8b_dir, tmp_path, dtype="fp16", kv_cache_dtype="fp8", max_context=4096)
    q16 = check_against_cli(p16.commands[0])
    assert Path(p16.commands[0][1]).name == "quantize.py"
    assert (q16.qformat, q16.kv_cache_dtype, q16.dtype) == ("full_prec", "fp8", "float16")
    b16 = check_against_cli(p16.commands[1])
    assert b16.use_fp8_context_fmha is None and b16.use_paged_context_fmha == "disable"
    assert (p16.values["enable_kv_cache_reuse"], p16.values["enable_chunked_context"]) == ("false", "false")
    assert "paged context FMHA off" in p16.notes[0]
    assert int(b16.tokens_per_block) == trtllm.TOKENS_PER_BLOCK


def test_small_model_fp16_with_lora_plugin(llama8b_dir: Path, tmp_path: Path) -> None:
    p = plan_for(llama8b_dir, tmp_path, max_context=4096, max_lora_rank=32)
    conv = check_against_cli(p.commands[0])
    assert p.commands[0][1].endswith("/llama/convert_checkpoint.py")
    assert conv.dtype == "bfloat16" and conv.tp_size == "1"  # no --dtype: the bf16 checkpoint stays bf16
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
    # the pinned backend (0.17) declares the guide inputs but ignores them: the preprocessing refuses
    # response_format instead of serving unconstrained output as if it were constrained
    assert params(cfgs["preprocessing"])["guided_decoding"] == "off"
    assert not trtllm.guided_decoding_supported(trtllm.TRTLLM_VERSION)
    assert trtllm.guided_decoding_supported("0.19.0") and trtllm.guided_decoding_supported("1.0.0")
    # warm before ready: Triton's model_warmup feeds every required input; its data files are in the repository
    (warm,) = t.model_warmup
    required = {i.name for i in t.input if not i.optional}
    assert set(warm.inputs) == required and warm.count >= 1
    for name, data in warm.inputs.items():
        if data.input_data_file:
            raw = (repo / "tensorrt_llm" / "warmup" / data.input_data_file).read_bytes()
            assert len(raw) == 4 * data.dims[0] and int.from_bytes(raw, "little") > 0, name  # int32 each
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
    # plus output_logprobs on GPU: there the router reads logprobs from the ensemble (on CPU from `engine` direct)
    extra = ['name: "output_logprobs" data_type: TYPE_FP32 dims: -1']
    assert shape(cpu.input) == shape(gpu.input) and shape(cpu.output) + extra == shape(gpu.output)
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
        if line.startswith(("trtllm-build ", "python3 ", "mpirun ")):
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


def _family_dir(tmp_path: Path, name: str, arch: str, dtype: str = "bfloat16", **extra) -> Path:
    """A Hugging Face folder with a small model's config of `arch` (plans read only config.json and names)."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 8192,
        "torch_dtype": dtype, **extra}))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.mark.parametrize("arch, family", [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "llama"),
                                          ("Qwen2ForCausalLM", "qwen"), ("GemmaForCausalLM", "gemma"),
                                          ("Gemma2ForCausalLM", "gemma"), ("Phi3ForCausalLM", "phi")])
def test_converter_per_architecture_keeps_the_dtype(tmp_path: Path, arch: str, family: str) -> None:
    """The planned converter is the family's own examples/<family>/convert_checkpoint.py, with that script's flag
    names, in the checkpoint's dtype; fp8 goes through ModelOpt for every family, calibrated locally."""
    ckpt = _family_dir(tmp_path, arch, arch)
    p = plan_for(ckpt, tmp_path, max_context=4096)
    conv = p.commands[0]
    assert conv[1] == f"/opt/TensorRT-LLM/examples/{family}/convert_checkpoint.py"
    ns = check_against_cli(conv)
    assert ns.dtype == "bfloat16"
    if family == "gemma":
        assert (ns.ckpt_type, ns.world_size, ns.model_dir) == ("hf", "1", str(ckpt))
    else:
        assert (ns.tp_size, ns.pp_size, ns.model_dir) == ("1", "1", str(ckpt))
    assert check_against_cli(p.commands[1]).use_paged_context_fmha == "enable"
    f16 = plan_for(ckpt, tmp_path / "f16", dtype="fp16", max_context=4096)
    assert check_against_cli(f16.commands[0]).dtype == "float16"  # an explicit --dtype wins
    fp8 = plan_for(ckpt, tmp_path / "fp8", dtype="fp8", max_context=4096)
    q = check_against_cli(fp8.commands[0])
    assert Path(fp8.commands[0][1]).name == "quantize.py" and (q.qformat, q.kv_cache_dtype, q.dtype) == \
        ("fp8", "fp8", "bfloat16")


def test_architectures_the_pinned_version_cannot_build_are_refused(tmp_path: Path) -> None:
    for arch, why in [("Qwen3ForCausalLM", "Qwen3 converters arrived after TensorRT-LLM 0.17.0"),
                      ("Gemma3ForCausalLM", "Gemma 3 converters arrived after"),
                      ("GPTNeoXForCausalLM", "has no TensorRT-LLM 0.17.0 converter; supported: ")]:
        with pytest.raises(BuildError, match=why) as err:
            plan_for(_family_dir(tmp_path, arch, arch), tmp_path, max_context=4096)
        assert err.value.field == "--checkpoint"


def test_quality_gate_steps_on_the_gpu_node(llama70b_dir: Path, tmp_path: Path) -> None:
    """The gate engine is the serving build's flags plus --gather_context_logits at the gate's shape; the
    reference and the scoring (one MPI rank per GPU) are separate processes; the report lands where the build
    reads it."""
    opts = parse_options(model="m", version="1", checkpoint=str(llama70b_dir), target="trtllm", dtype="fp8",
                         max_context=8192)
    plan = trtllm.effective_plan(resolve(opts, inspect_checkpoint(str(llama70b_dir))))
    gate = trtllm.GateOptions(prompts=32, thresholds={"min_agreement": 0.85})
    p = trtllm.plan_trtllm(plan, tmp_path / "w", tmp_path / "s", tmp_path / "a", "/ex", None, gate)
    serve, gate_build, ref, score = p.commands[1], p.commands[4], p.commands[5], p.commands[6]
    b, g = check_against_cli(serve), check_against_cli(gate_build)
    assert g.gather_context_logits and not b.gather_context_logits
    assert g.checkpoint_dir == b.checkpoint_dir and g.use_fp8_context_fmha == "enable"  # same weights, same fp8
    assert (g.max_batch_size, g.max_seq_len) == ("8", "512") and g.output_dir != b.output_dir
    r, s = check_against_cli(ref), check_against_cli(score)
    assert r.step == "reference" and r.checkpoint == str(llama70b_dir) and r.prompts == 32
    assert score[:4] == ["mpirun", "--allow-run-as-root", "-n", "4"] and s.engine_dir == g.output_dir
    assert s.reference == r.out and s.dtype == "fp8" and s.threshold == ["min_agreement=0.85"]
    assert p.gate_report == Path(s.out)
    skipped = trtllm.plan_trtllm(plan, tmp_path / "w", tmp_path / "s", tmp_path / "a", "/ex", None,
                                 trtllm.GateOptions(skip_reason="INC-9: no spare GPU for the reference"))
    assert len(skipped.commands) == 4 and skipped.gate_report is None


def test_calibration_set_must_be_local(llama70b_dir: Path, be_settings: Settings, sqlite_url: str,
                                       tmp_path: Path) -> None:
    opts = parse_options(model="m", version="1", checkpoint=str(llama70b_dir), target="trtllm", dtype="fp8")
    with pytest.raises(BuildError, match="--calib-dataset cnn_dailymail is not a local folder"):
        build(opts, be_settings, sqlite_url, calib_dataset="cnn_dailymail")
    plan = build(opts.model_copy(update={"dry_run": True}), be_settings, sqlite_url,
                 calib_dataset=str(tmp_path)).plan_text
    assert f"--calib_dataset {tmp_path}" in plan
    with pytest.raises(BuildError, match="--calib-dataset: only the trtllm target calibrates"):
        build(parse_options(model="m", version="1", checkpoint="smollm2"), be_settings, sqlite_url,
              calib_dataset=str(tmp_path))
