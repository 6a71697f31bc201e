"""Make many PEFT-format LoRA adapters for scale tests (adapter cache churn, many adapters per batch).

Each adapter is random (seeded by its index) with the shape of the shipped ones: rank 4 on every projection
of the upper layers. They change outputs but mean nothing; they are written outside the repo by default.

    python -m bench.engine.make_adapters --count 50 --out .fleet/cache/adapters-many
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = {"q_proj": ("self_attn", 576, 576), "k_proj": ("self_attn", 576, 192), "v_proj": ("self_attn", 576, 192),
           "o_proj": ("self_attn", 576, 576), "gate_proj": ("mlp", 576, 1536), "up_proj": ("mlp", 576, 1536),
           "down_proj": ("mlp", 1536, 576)}


def make(out: Path, count: int, rank: int = 4, layers: range = range(22, 30), scale: float = 0.02) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    paths = []
    for i in range(count):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in layers:
            for name, (block, fin, fout) in TARGETS.items():
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) / fin ** 0.5).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * scale).to(torch.bfloat16)
        path = out / f"random-{i:03d}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "layers_to_transform": list(layers), "bias": "none",
            "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, indent=2))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(".fleet/cache/adapters-many"))
    args = parser.parse_args()
    print(f"wrote {len(make(args.out, args.count, args.rank))} adapters under {args.out}")


if __name__ == "__main__":
    main()
