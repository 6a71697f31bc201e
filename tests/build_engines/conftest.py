"""Fixtures of the build_engines tests: a throwaway data dir per test (the conversion cache stays shared,
so SmolLM2 is converted at most once per machine) and a small Llama-70B-shaped HF folder for trtllm plans."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.settings import Settings, load_settings


@pytest.fixture
def be_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("FLEET_DATA_DIR", str(tmp_path / "data"))
    return load_settings()


@pytest.fixture
def llama70b_dir(tmp_path: Path) -> Path:
    """A Hugging Face folder with Llama-3.1-70B's config.json; its weight file is a placeholder because
    only `--dry-run` plans read it here (the real build runs on GPU nodes)."""
    d = tmp_path / "Llama-3.1-70B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}))
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model-00001-of-00030.safetensors").write_bytes(b"")
    return d


@pytest.fixture
def llama8b_dir(tmp_path: Path) -> Path:
    """Llama-3.1-8B's config.json (the small base model that carries the LoRA fine-tunes)."""
    d = tmp_path / "Llama-3.1-8B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}))
    (d / "tokenizer.json").write_text("{}")
    (d / "model-00001-of-00004.safetensors").write_bytes(b"")
    return d
