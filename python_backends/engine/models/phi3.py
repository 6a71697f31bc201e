"""Phi-3: Llama's block with fused `qkv_proj` and `gate_up_proj` checkpoints (already in the engine's fused
layout: q, k, v rows; gate rows then up rows) and a sliding window over every layer (Phi-3-mini-4k: 2047)."""
from __future__ import annotations

from typing import Any

import torch

from python_backends.engine.models.llama import Getter, LlamaModel


class Phi3Model(LlamaModel):
    def load_layer(self, p: str, w: dict[str, torch.Tensor], get: Getter, linear: Getter) -> dict[str, Any]:
        a, m = p + "self_attn.", p + "mlp."
        qkv = linear(a + "qkv_proj.weight")
        want = (self.n_heads + 2 * self.n_kv) * self.head_dim
        if qkv.shape[0] != want:
            raise ValueError(f"{a}qkv_proj.weight has {qkv.shape[0]} rows; expected (heads + 2 kv_heads) * "
                             f"head_dim = {want}")
        return {"in_norm": get(p + "input_layernorm.weight"), "post_norm": get(p + "post_attention_layernorm.weight"),
                "qkv": qkv.contiguous(), "o": linear(a + "o_proj.weight"),
                "gate_up": linear(m + "gate_up_proj.weight").contiguous(), "down": linear(m + "down_proj.weight"),
                "qkv_b": None, "o_b": None, "gate_up_b": None, "down_b": None}
