"""build-engines --target cpu refuses, before any work or registry row, every checkpoint the engine would serve
wrong: architectures outside the allow-list and config features (RoPE types, biases, activations, partial
rotary, multimodal wrappers), each error naming the config field, its value and what is supported. GGUF files
without <arch>.vocab_size take the vocabulary size from their tokenizer.

The configs are transformers' own (its config classes, saved as a checkpoint would ship them); the weights are a
placeholder since a refused build never reads them."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from build_engines.build import build
from build_engines.plan import BuildError, gguf_config, inspect_checkpoint, parse_options, resolve
from common.settings import Settings


def _folder(tmp_path: Path, name: str, config_cls: str, **over) -> Path:
    import transformers
    cfg = getattr(transformers, config_cls)(**{k: v for k, v in over.items() if not k.startswith("_")})
    d = tmp_path / name
    cfg.save_pretrained(d)
    raw = json.loads((d / "config.json").read_text())
    # as a saved model writes it: architectures = its causal-LM class
    raw["architectures"] = [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    raw.update({k[1:]: v for k, v in over.items() if k.startswith("_")})   # fields set as a hand-edited config
    (d / "config.json").write_text(json.dumps(raw))
    (d / "model.safetensors").write_bytes(b"")
    return d


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=300)
CASES = [
    ("gpt2", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300), "architectures='GPT2LMHeadModel'"),
    ("neox", "GPTNeoXConfig", dict(SMALL), "architectures='GPTNeoXForCausalLM'"),
    ("yarn", "LlamaConfig", dict(SMALL, _rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling.rope_type='yarn'"),
    ("longrope", "Phi3Config", dict(SMALL, _rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "rope_parameters.rope_type='longrope'"),
    ("relu", "LlamaConfig", dict(SMALL, hidden_act="relu"), "hidden_act='relu'"),
    ("qwen2-mlp-bias", "Qwen2Config", dict(SMALL, _mlp_bias=True), "mlp_bias=True"),
    ("partial-rotary", "Phi3Config", dict(SMALL, _partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("gemma3-vision", "LlamaConfig", dict(SMALL, _architectures=["Gemma3ForConditionalGeneration"]),
     "architectures='Gemma3ForConditionalGeneration'"),
]


@pytest.mark.parametrize("name,config_cls,over,text", CASES, ids=[c[0] for c in CASES])
def test_unsupported_checkpoint_is_refused_before_any_work(be_settings: Settings, sqlite_url: str, tmp_path: Path,
                                                           name: str, config_cls: str, over: dict, text: str) -> None:
    ckpt = _folder(tmp_path, name, config_cls, **over)
    opts = parse_options(model="byo", version="1", checkpoint=str(ckpt), target="cpu", dtype="fp32")
    with pytest.raises(BuildError) as err:
        build(opts, be_settings, sqlite_url)
    msg = str(err.value)
    assert err.value.field == "--checkpoint" and text in msg and "supported:" in msg, msg
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()      # no registry row, not even `failed`
    assert not be_settings.engines_dir.exists() or not any(be_settings.engines_dir.rglob("*"))


def test_supported_families_pass_the_allow_list(tmp_path: Path) -> None:
    for cls in ("LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "GemmaConfig", "Gemma2Config",
                "Gemma3TextConfig", "Phi3Config"):
        ckpt = _folder(tmp_path, cls, cls, **SMALL)
        plan = resolve(parse_options(model="byo", version="1", checkpoint=str(ckpt)), inspect_checkpoint(str(ckpt)))
        assert plan.ckpt.config["architecture"].endswith("ForCausalLM")


def _gguf(path: Path, arch: str, tokens: int | None, vocab_size: int | None = None) -> Path:
    """A GGUF v3 header with metadata only (no tensors): what plan.py reads."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()
    kv = [s("general.architecture") + struct.pack("<I", 8) + s(arch),
          s(f"{arch}.attention.head_count") + struct.pack("<II", 4, 4),
          s(f"{arch}.context_length") + struct.pack("<II", 4, 2048)]
    if vocab_size is not None:
        kv.append(s(f"{arch}.vocab_size") + struct.pack("<II", 4, vocab_size))
    if tokens is not None:
        kv.append(s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, tokens)
                  + b"".join(s(f"t{i}") for i in range(tokens)))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


def test_gguf_vocab_size_comes_from_the_tokenizer_when_metadata_lacks_it(tmp_path: Path) -> None:
    assert gguf_config(_gguf(tmp_path / "a.gguf", "qwen2", tokens=7))["vocab_size"] == 7
    assert gguf_config(_gguf(tmp_path / "b.gguf", "qwen2", tokens=7, vocab_size=9))["vocab_size"] == 9
    assert gguf_config(tmp_path / "a.gguf")["architectures"] == ["Qwen2ForCausalLM"]
    with pytest.raises(BuildError, match="vocabulary size is unknown") as err:
        gguf_config(_gguf(tmp_path / "c.gguf", "qwen2", tokens=None))
    assert err.value.field == "--checkpoint"


def test_gguf_of_an_unsupported_architecture_is_refused(be_settings: Settings, sqlite_url: str,
                                                        tmp_path: Path) -> None:
    opts = parse_options(model="byo", version="1", checkpoint=str(_gguf(tmp_path / "n.gguf", "gptneox", 5)))
    with pytest.raises(BuildError, match="architectures='gguf:gptneox'.*supported: LlamaForCausalLM"):
        build(opts, be_settings, sqlite_url)
    assert not Path(sqlite_url.removeprefix("sqlite:///")).exists()


def test_accepted_family_is_built_staged_and_loads(be_settings: Settings, sqlite_url: str, tmp_path: Path,
                                                   smollm2_dir: Path) -> None:
    """A tiny random Qwen3 (transformers, SmolLM2's tokenizer) through the whole cpu build: staged, and the engine
    loads the version's node-local weights as the Qwen3 family."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from build_engines.register import read_row
    from python_backends.engine.model_runner import ModelRunner

    torch.manual_seed(0)
    # the tokenizer's whole vocabulary: the build's quality gate feeds it real prompts
    config = Qwen3Config(**{**SMALL, "vocab_size": 49152}, head_dim=16, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    ckpt = tmp_path / "qwen3-tiny"
    model.save_pretrained(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, ckpt / name)
    result = build(parse_options(model="byo-qwen3", version="1", checkpoint=str(ckpt), dtype="fp32"),
                   be_settings, sqlite_url)
    assert result.outcome == "built" and read_row(sqlite_url, "byo-qwen3", "1")["status"] == "staged"
    runner = ModelRunner(Path(result.files["weights"]), "fp32", 8, 16, 64)
    assert type(runner.model).__name__ == "Qwen3Model" and "q_norm" in runner.layers[0]
