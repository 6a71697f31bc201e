"""PEFT -> TensorRT-LLM LoRA conversion on the shipped adapters, and the Triton launcher's plan per world size."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from build_engines.launch import plan_launch
from build_engines.lora_convert import MODULE_IDS, LoraConvertError, convert_peft
from common.settings import REPO_ROOT

FRENCH = REPO_ROOT / "adapters" / "smollm2-135m" / "french"


def test_shipped_adapter_converts_to_the_backend_layout(tmp_path: Path) -> None:
    rows, rank = convert_peft(FRENCH, tmp_path)
    cfg = json.loads((FRENCH / "adapter_config.json").read_text())
    weights, config = np.load(tmp_path / "model.lora_weights.npy"), np.load(tmp_path / "model.lora_config.npy")
    layers, modules = cfg["layers_to_transform"], cfg["target_modules"]
    assert rank == cfg["r"] and rows == len(layers) * len(modules)
    assert weights.dtype == np.float16 and weights.shape[:2] == (1, rows)   # [1, modules x layers, D*Hi + Ho*D]
    assert config.dtype == np.int32 and config.shape == (1, rows, 3)        # [module_id, layer, adapter_size]
    assert {tuple(r) for r in config[0]} == {(MODULE_IDS[m], layer, rank) for m in modules for layer in layers}
    # one row in full: A flattened, then B flattened and scaled by alpha / r
    peft = load_file(str(FRENCH / "adapter_model.safetensors"))
    i = next(k for k, r in enumerate(config[0]) if tuple(r) == (MODULE_IDS["up_proj"], layers[0], rank))
    a = peft[f"base_model.model.model.layers.{layers[0]}.mlp.up_proj.lora_A.weight"].float()
    b = peft[f"base_model.model.model.layers.{layers[0]}.mlp.up_proj.lora_B.weight"].float()
    want = torch.cat([a.reshape(-1), (b * cfg["lora_alpha"] / rank).reshape(-1)]).half().numpy()
    assert np.array_equal(weights[0, i, : want.size], want) and not weights[0, i, want.size:].any()
    assert MODULE_IDS["gate_proj"] == 5 and MODULE_IDS["up_proj"] == 7  # TensorRT-LLM's Llama naming


def test_not_a_peft_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoraConvertError, match="not a PEFT adapter"):
        convert_peft(tmp_path, tmp_path / "out")


def test_one_gpu_is_a_plain_tritonserver() -> None:
    cmd = plan_launch(1, "/repo")
    assert cmd[0] == "tritonserver" and "mpirun" not in cmd and "--model-repository=/repo" in cmd


def test_tensor_parallel_4_is_one_mpi_rank_per_gpu_rank0_serving_the_repository() -> None:
    cmd = plan_launch(4, "/repo")
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = [shlex.split(part) for part in shlex.join(cmd[2:]).split(" : ")]
    assert len(ranks) == 4 and all(r[:3] == ["-n", "1", "tritonserver"] for r in ranks)
    assert "--model-control-mode=explicit" not in ranks[0]  # rank 0 loads the ensemble and serves callers
    for i, rank in enumerate(ranks):
        assert f"--backend-config=python,shm-region-prefix-name=prefix{i}_" in rank
        if i:
            assert rank[-2:] == ["--model-control-mode=explicit", "--load-model=tensorrt_llm"]
    with pytest.raises(ValueError, match="world-size"):
        plan_launch(0, "/repo")
