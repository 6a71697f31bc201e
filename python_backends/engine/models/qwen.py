"""Qwen2 / Qwen2.5 (Llama with q/k/v biases, loaded by the shared loader) and Qwen3 (per-head RMSNorm of q and
k before RoPE, no biases unless attention_bias)."""
from __future__ import annotations

from python_backends.engine.models.llama import LlamaModel, QKNormed


class Qwen2Model(LlamaModel):
    def layer_types(self) -> list[str]:
        # transformers 4 configs carry sliding_window even with use_sliding_window false (the window is then
        # off); transformers 5 writes layer_types: the first max_window_layers layers are full either way
        if self.cfg.get("layer_types"):
            return list(self.cfg["layer_types"])
        if not self.cfg.get("use_sliding_window"):
            return ["full_attention"] * self.n_layers
        first = self.cfg.get("max_window_layers", self.n_layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(self.n_layers)]


class Qwen3Model(QKNormed, Qwen2Model):
    """Qwen2 plus per-head q/k RMSNorm before RoPE (QKNormed)."""
