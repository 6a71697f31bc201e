"""Every family the engine serves computes what transformers computes: per architecture a tiny random checkpoint
made here with transformers (no downloads; SmolLM2's tokenizer), converted by build-engines' cpu conversion,
loaded by the engine from the converted folder, with the fused CPU kernels on and off.

Checked per family: the architecture passes the build allow-list; prompt logits (teacher forcing) within
LOGIT_TOL of transformers' fp32 logits; greedy ids equal to transformers' greedy generate for two prompts run
together in chunked, mixed steps (prompts longer than the sliding windows, so windows bind in prefill and
decode). Weights are scaled up (initializer_range) so random logits are not near-ties.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from build_engines import cpu
from build_engines.plan import inspect_checkpoint, parse_options, resolve
from common.settings import REPO_ROOT
from python_backends.engine.config import EngineConfig
from python_backends.engine.engine import LLMEngine
from tests.engine.random_llama import prefill_logits, run_all
from tests.engine.test_triton_engine import router_stub  # noqa: F401  (the fixture: a state-report sink)

LOGIT_TOL = 2e-4       # fp32: the same math in another order (fused QKV GEMM, kernels' roundings)
NEW_TOKENS = 20
WINDOW = 8             # sliding windows far below the prompts' lengths
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "llama-bias-gelu": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu",
                                            tie_word_embeddings=False)),
    "qwen2-tied-sharded": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "phi3-window": ("Phi3Config", dict(sliding_window=WINDOW, tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", dict(hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=WINDOW, query_pre_attn_scalar=32,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1000000.0}})),
}
MODEL_CLASS = {"LlamaForCausalLM": "LlamaModel", "Qwen2ForCausalLM": "Qwen2Model", "Qwen3ForCausalLM": "Qwen3Model",
               "MistralForCausalLM": "MistralModel", "Phi3ForCausalLM": "Phi3Model", "GemmaForCausalLM": "GemmaModel",
               "Gemma2ForCausalLM": "Gemma2Model", "Gemma3ForCausalLM": "Gemma3Model"}


def _hf_model(family: str, vocab: int):
    import transformers
    from transformers import AutoModelForCausalLM
    config_cls, over = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**{**BASE, **over, "vocab_size": vocab})
    cfg._attn_implementation = "eager"       # the reference: soft-capping and windows as written
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


@pytest.fixture(scope="module")
def converted(smollm2_dir: Path, tmp_path_factory):
    """family -> (transformers model, converted folder); each made once per module run."""
    cache: dict[str, tuple] = {}
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            model = _hf_model(family, vocab)
            ckpt = root / "checkpoint"
            # the sharded save: model-0000x-of-0000y.safetensors + index, as large checkpoints ship
            model.save_pretrained(ckpt, max_shard_size="2MB" if "sharded" in family else "2GB")
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (smollm2_dir / name).exists():
                    shutil.copy(smollm2_dir / name, ckpt / name)
            # what `build-engines --target cpu` runs: the allow-list (plan), then the conversion
            plan = resolve(parse_options(model="m", version="v1", checkpoint=str(ckpt), dtype="fp32"),
                           inspect_checkpoint(str(ckpt)))
            assert plan.ckpt.config["architecture"] == model.config.architectures[0]
            out = cpu.convert_checkpoint(ckpt, root / "converted", "fp32")
            if "sharded" in family:
                # the conversion writes one file at this size; a large model's converted folder is sharded
                # like its source, so the engine serves the sharded source folder here
                assert len(list(ckpt.glob("model-*-of-*.safetensors"))) > 1
                assert (ckpt / "model.safetensors.index.json").exists() and not (ckpt / "model.safetensors").exists()
                out = ckpt
            cache[family] = (model, out)
        return cache[family]
    return get


def _engine(weights: Path, kernels: str) -> LLMEngine:
    return LLMEngine(EngineConfig(weights_dir=str(weights), dtype="fp32", cpu_kernels=kernels, max_context=256,
                                  num_kv_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=24,
                                  threads=1))


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(converted, family: str, kernels: str):
    from python_backends.engine import cpu_kernels
    if kernels == "on" and cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernels could not be built on this machine")
    torch.set_num_threads(1)
    model, weights = converted(family)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (30, 19)]
    eng = _engine(weights, kernels)
    assert (eng.runner.kernels is not None) == (kernels == "on")
    assert type(eng.runner.model).__name__ == MODEL_CLASS[model.config.architectures[0]]

    with torch.inference_mode():
        ref = model(torch.tensor([prompts[0]])).logits[0].float()
    got = prefill_logits(_engine(weights, kernels), prompts[0])
    delta = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()

    outs = run_all(eng, [(p, NEW_TOKENS, "") for p in prompts])
    want = [_hf_greedy(model, p) for p in prompts]
    agree = sum(a == b for o, w in zip(outs, want) for a, b in zip(o, w)) / (2 * NEW_TOKENS)
    print(f"\n{family} kernels {kernels}: max |logit delta| {delta:.2e}, prefill top-1 {top1:.0%}, "
          f"greedy agreement {agree:.0%}")
    assert delta < LOGIT_TOL, f"{family}: logits differ by {delta}"
    assert outs == want


def test_engine_refuses_an_unsupported_folder_at_load(converted, tmp_path):
    """A folder copied in by hand (never through build-engines) is refused when the engine loads it, naming the
    field, not served wrong."""
    from python_backends.engine.models.support import UnsupportedModel
    _, weights = converted("qwen2-untied")
    for over, field in (({"architectures": ["GPTNeoXForCausalLM"]}, "architectures"),
                        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
                         "rope_parameters.rope_type")):
        folder = tmp_path / field
        shutil.copytree(weights, folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **over}))
        with pytest.raises(UnsupportedModel) as err:
            _engine(folder, "off")
        assert err.value.field == field and "supported:" in str(err.value)


@pytest.mark.parametrize("family,why", [("mistral-window", "sliding_window=8 below max_context 256"),
                                        ("gemma2", "attn_logit_softcapping=5.0")])
def test_windows_and_softcap_are_refused_on_cuda_with_the_reason(converted, family: str, why: str):
    """The CUDA paged kernel has no window or soft-cap: refused at load, before any CUDA call (runs without a GPU)."""
    from python_backends.engine.model_runner import ModelRunner
    _, weights = converted(family)
    with pytest.raises(ValueError, match=f"{why} is not implemented by the CUDA paged attention"):
        ModelRunner(weights, "fp32", 16, 16, 256, device="cuda")


@pytest.mark.integration
def test_qwen2_served_by_a_real_replica_matches_transformers(converted, settings, router_stub, tmp_path):
    """The converted Qwen2 checkpoint behind a real tritonserver (the `engine` model): streamed greedy ids equal
    transformers' generate."""
    from build_engines.triton_repo import cpu_values, render_repository
    from common.processes import free_port, stop_pid
    from common.services import start_triton
    from tests.engine.test_triton_engine import _inputs, _stream

    model, weights = converted("qwen2-untied")
    (tmp_path / "adapters").mkdir()
    repo = render_repository(tmp_path / "repo", cpu_values(weights, tmp_path / "adapters", 256, "fp32"),
                             steps=("engine",))
    base = free_port()
    env = {"FLEET_ENGINE_DTYPE": "fp32", "FLEET_ENGINE_NUM_KV_BLOCKS": "64", "FLEET_ROUTER_URLS": router_stub,
           "FLEET_REPLICA_ID": "qwen2-replica", "FLEET_MODEL": "byo-qwen2", "FLEET_VERSION": "1"}
    proc = start_triton(settings, repo, base, tmp_path / "triton.log", extra_env=env)
    try:
        prompt = [random.Random(11).randrange(3, 40000) for _ in range(25)]
        responses = _stream(f"127.0.0.1:{base + 1}", "engine", _inputs(prompt, NEW_TOKENS), {"llm_priority": 0})
        ids = [int(t) for r in responses for t in r.as_numpy("output_ids").reshape(-1)]
    finally:
        stop_pid(proc.pid)
    assert ids == _hf_greedy(model, prompt)


def test_cuda_attention_path_runs_a_new_family_in_the_triton_interpreter(tmp_path):
    """Qwen3 (q/k norms, tied) through the CUDA attention path (paged Triton kernel) run by Triton's CPU
    interpreter: greedy ids equal transformers' in chunked mixed steps. Families without a binding window or
    soft-cap share this path on a GPU; the kernel itself is covered for Llama in test_engine_numerics."""
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import random, torch
        from pathlib import Path
        from tests.engine import test_architectures as T
        from tests.engine.random_llama import run_all
        from python_backends.engine.config import EngineConfig
        from python_backends.engine.engine import LLMEngine
        torch.set_num_threads(1)
        model = T._hf_model("qwen3", 2000)
        model.save_pretrained("{tmp_path}")
        eng = LLMEngine(EngineConfig(weights_dir="{tmp_path}", dtype="fp32", cpu_kernels="off", max_context=256,
                                     num_kv_blocks=64, max_num_batched_tokens=24, threads=1))
        eng.runner.paged = True                       # the CUDA attention path, on CPU tensors
        rng = random.Random(3)
        reqs = [([rng.randrange(3, 2000) for _ in range(n)], 6, "") for n in (30, 11)]
        got = run_all(eng, reqs)
        assert got == [T._hf_greedy(model, p)[:6] for p, _, _ in reqs], got
        print("OK")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
