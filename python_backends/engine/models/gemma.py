"""Gemma 1, 2 and 3 (text): RMSNorm scaled by (1 + w), embeddings scaled by sqrt(hidden), GELU (tanh) gated MLP.

Gemma 2 adds norms after attention and after the MLP (pre/post feed-forward norms), attention scaled by
query_pre_attn_scalar**-0.5, soft-capped attention and final logits, and alternating sliding/global layers.
Gemma 3 drops the soft-capping, adds per-head q/k norms, and gives sliding and global layers their own RoPE
(base 10,000 local; the global base and scaling from rope_parameters / rope_theta + rope_scaling).
"""
from __future__ import annotations

from typing import Any

import torch

from python_backends.engine.models.layers import TorchOps
from python_backends.engine.models.llama import Getter, LlamaModel, QKNormed


class GemmaModel(LlamaModel):
    TIE_DEFAULT = True

    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        self.embed_scale = self.hidden ** 0.5

    def norm_weight(self, t: torch.Tensor) -> torch.Tensor:
        # Gemma's norm multiplies by (1 + w) in fp32: folded in once, the shared RMSNorm then applies it
        return (1.0 + t.float()).to(t.dtype)


class Gemma2Model(GemmaModel):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__(cfg)
        self.final_softcap = cfg.get("final_logit_softcapping")

    def q_scale(self) -> float:
        # the attention scales by head_dim**-0.5; Gemma 2/3 by query_pre_attn_scalar**-0.5
        return (self.head_dim / self.cfg.get("query_pre_attn_scalar", self.head_dim)) ** 0.5

    def attn_softcap(self) -> float | None:
        return self.cfg.get("attn_logit_softcapping")

    def layer_types(self) -> list[str]:
        # transformers 4 configs: Gemma 2 alternates sliding (even layers) and global
        return list(self.cfg.get("layer_types")
                    or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.n_layers)])

    def load_layer(self, p: str, w: dict[str, torch.Tensor], get: Getter, linear: Getter) -> dict[str, Any]:
        L = super().load_layer(p, w, get, linear)
        L["pre_ff_norm"] = self.norm_weight(get(p + "pre_feedforward_layernorm.weight"))
        L["post_ff_norm"] = self.norm_weight(get(p + "post_feedforward_layernorm.weight"))
        return L

    def forward(self, r, batch, ops: TorchOps) -> torch.Tensor:
        """Sandwich blocks: x += post_norm(attn(in_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x)))."""
        x = self.embed_tokens(batch.input_ids)
        h = ops.rms_norm(x, self.layers[0]["in_norm"])
        for li, L in enumerate(self.layers):
            attn = ops.rms_norm(self.attention(r, li, L, h, batch, ops), L["post_norm"])
            h = ops.add_rms_norm(x, attn, L["pre_ff_norm"])
            down = ops.rms_norm(self.mlp(r, li, L, h, batch, ops), L["post_ff_norm"])
            if li + 1 < self.n_layers:
                h = ops.add_rms_norm(x, down, self.layers[li + 1]["in_norm"])
            else:
                x.add_(down)
        return self.logits(r, x.index_select(0, batch.logits_rows), ops)


class Gemma3Model(QKNormed, Gemma2Model):
    def layer_types(self) -> list[str]:
        pattern = self.cfg.get("sliding_window_pattern") or self.cfg.get("_sliding_window_pattern") or 6
        return list(self.cfg.get("layer_types")
                    or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.n_layers)])

    def rope_config(self, li: int) -> dict[str, Any]:
        kind = self.layer_types()[li]
        rp = self.cfg.get("rope_parameters") or {}
        if isinstance(rp.get(kind), dict):                  # transformers 5: one RoPE setting per layer type
            return {"rope_parameters": rp[kind]}
        if kind == "sliding_attention":                     # transformers 4: local base, never scaled
            return {"rope_theta": self.cfg.get("rope_local_base_freq", 10000.0)}
        return {k: v for k, v in self.cfg.items() if k in ("rope_theta", "rope_scaling", "rope_parameters")}
