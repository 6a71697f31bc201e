"""PEFT LoRA adapter -> TensorRT-LLM's LoRA tensors (`model.lora_weights.npy`, `model.lora_config.npy`).

The layout is the one the tensorrtllm backend documents for its `lora_weights` / `lora_config` inputs and that
TensorRT-LLM's examples/hf_lora_convert.py writes:
- one row per (module, layer): lora_config row = [module_id, layer_idx, adapter_size];
- lora_weights row = in weights (PEFT lora_A, [r, hidden_in]) flattened, then out weights (lora_B,
  [hidden_out, r]) flattened and scaled by alpha / r (alpha / sqrt(r) with rsLoRA), zero-padded to the widest row;
- both saved with a leading batch dim of 1, weights in float16.
Module ids are TensorRT-LLM's LoraModule types; note its Llama naming: gate_proj -> mlp_h_to_4h (5),
up_proj -> mlp_gate (7), down_proj -> mlp_4h_to_h (6).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
KEY = re.compile(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")


class LoraConvertError(ValueError):
    pass


def convert_peft(adapter_dir: Path, out_dir: Path) -> tuple[int, int]:
    """Convert one PEFT adapter folder; returns (rows, adapter_size). Writes both files atomically."""
    cfg_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise LoraConvertError(f"{adapter_dir}: not a PEFT adapter (needs adapter_config.json and "
                               "adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraConvertError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        m = KEY.match(key)
        if m is None:
            raise LoraConvertError(f"{adapter_dir}: unexpected tensor {key!r}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULE_IDS:
            raise LoraConvertError(f"{adapter_dir}: module {module!r} has no TensorRT-LLM LoRA module "
                                   f"(supported: {', '.join(MODULE_IDS)})")
        pairs.setdefault((layer, module), {})[ab] = tensor.float()
    rows, config = [], []
    for (layer, module), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], MODULE_IDS[kv[0][1]])):
        if set(ab) != {"A", "B"}:
            raise LoraConvertError(f"{adapter_dir}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"] * scale  # A: [r, in], B: [out, r]
        rows.append(torch.cat([a.reshape(-1), b.reshape(-1)]))
        config.append([MODULE_IDS[module], layer, a.shape[0]])
    if not rows:
        raise LoraConvertError(f"{adapter_dir}: no LoRA weights")
    width = max(r.numel() for r in rows)
    weights = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        weights[i, : r.numel()] = r
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, array in (("model.lora_weights.npy", weights.numpy().astype(np.float16)[None]),
                        ("model.lora_config.npy", np.array(config, dtype=np.int32)[None])):
        tmp = out_dir / f".{name}.partial"
        with tmp.open("wb") as fh:
            np.save(fh, array)
        tmp.replace(out_dir / name)
    return len(rows), rank
