"""Llama: the decoder the other families extend (pre-norm blocks, GQA attention with RoPE, gated MLP).

Covers Llama 1-3.x and SmolLM: `attention_bias` (q/k/v/o biases), `mlp_bias`, `hidden_act` silu or gelu, tied or
untied embeddings, RoPE default / llama3 / linear. A family subclass overrides only what differs: how weights
load (`load_layer`), a q/k step before RoPE (`qk_norm`), the block (`layer`), the window per layer.
The attention itself, the KV pool and the batch metadata belong to the ModelRunner; a model reads them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from python_backends.engine.models.layers import TorchOps, head_norm, softcap
from python_backends.engine.rope import rope_tables

Getter = Callable[[str], torch.Tensor]


class LlamaModel:
    # projections the runner packs for its GEMMs (and LoRA applies to), in load order
    LINEARS = ("qkv", "o", "gate_up", "down")
    TIE_DEFAULT = False           # the family's config default when config.json omits tie_word_embeddings

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.hidden = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        self.eps = cfg["rms_norm_eps"]
        self.act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        self.final_softcap: float | None = None
        self.embed_scale: float | None = None
        self.layers: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ config per layer
    def q_scale(self) -> float:
        """Factor applied to q after RoPE so that the attention's own head_dim**-0.5 gives the model's scale."""
        return 1.0

    def layer_types(self) -> list[str]:
        return list(self.cfg.get("layer_types") or ["sliding_attention"] * self.n_layers)

    def window(self, li: int, max_context: int) -> int | None:
        """Keys a query at position p sees: p - window < k <= p (transformers' sliding mask); None = all.
        A window at least max_context never binds, so it is dropped (the plain attention paths then apply)."""
        w = self.cfg.get("sliding_window")
        if w is None or self.layer_types()[li] != "sliding_attention" or w >= max_context:
            return None
        return int(w)

    def attn_softcap(self) -> float | None:
        return None

    def rope_config(self, li: int) -> dict[str, Any]:
        """The config rope.py reads for layer li (all layers share one here)."""
        return self.cfg

    def build_rope(self, positions: int, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """(cos, sin) per layer; layers with equal settings share one table."""
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        out = []
        for li in range(self.n_layers):
            rc = self.rope_config(li)
            key = repr(sorted((k, repr(v)) for k, v in rc.items() if "rope" in k))
            if key not in tables:
                tables[key] = rope_tables(rc, self.head_dim, positions, dtype, device)
            out.append(tables[key])
        return out

    # ------------------------------------------------------------------ weights
    def norm_weight(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def load(self, w: dict[str, torch.Tensor], get: Getter, linear: Getter) -> None:
        self.embed = get("model.embed_tokens.weight")
        if self.cfg.get("tie_word_embeddings", self.TIE_DEFAULT):
            self.lm_head = self.embed
        elif "lm_head.weight" in w:
            self.lm_head = linear("lm_head.weight")
        else:
            raise ValueError("config.json tie_word_embeddings=false but the checkpoint has no lm_head.weight")
        self.final_norm = self.norm_weight(get("model.norm.weight"))
        self.layers = [self.load_layer(f"model.layers.{i}.", w, get, linear) for i in range(self.n_layers)]

    def load_layer(self, p: str, w: dict[str, torch.Tensor], get: Getter, linear: Getter) -> dict[str, Any]:
        a, m = p + "self_attn.", p + "mlp."
        L = {"in_norm": self.norm_weight(get(p + "input_layernorm.weight")),
             "post_norm": self.norm_weight(get(p + "post_attention_layernorm.weight")),
             # fused projections: one GEMM instead of three (two), fewer dispatches per layer
             "qkv": torch.cat([linear(a + f"{x}_proj.weight") for x in "qkv"]).contiguous(),
             "o": linear(a + "o_proj.weight"),
             "gate_up": torch.cat([linear(m + "gate_proj.weight"), linear(m + "up_proj.weight")]).contiguous(),
             "down": linear(m + "down_proj.weight")}
        # biases wherever the checkpoint has them (Qwen2 q/k/v; Llama attention_bias, mlp_bias)
        L["qkv_b"] = self._bias(w, get, [a + f"{x}_proj.bias" for x in "qkv"], L["qkv"].shape[0])
        L["o_b"] = self._bias(w, get, [a + "o_proj.bias"], L["o"].shape[0])
        L["gate_up_b"] = self._bias(w, get, [m + "gate_proj.bias", m + "up_proj.bias"], L["gate_up"].shape[0])
        L["down_b"] = self._bias(w, get, [m + "down_proj.bias"], L["down"].shape[0])
        return L

    @staticmethod
    def _bias(w: dict[str, torch.Tensor], get: Getter, names: list[str], rows: int) -> torch.Tensor | None:
        if not any(n in w for n in names):
            return None
        missing = [n for n in names if n not in w]
        if missing:
            raise ValueError(f"checkpoint has some but not all of the biases {names}: missing {missing}")
        b = torch.cat([get(n) for n in names])
        assert b.shape[0] == rows, (names, b.shape, rows)
        return b

    # ------------------------------------------------------------------ forward
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        if self.embed_scale is not None:      # Gemma: the scale rounded to the activations' dtype, as transformers
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def proj(self, r, x: torch.Tensor, L: dict[str, Any], name: str, li: int, batch) -> torch.Tensor:
        y = r.lin(x, L[name], li, name, batch)
        b = L[name + "_b"]
        return y if b is None else y.add_(b)

    def qk_norm(self, qkv: torch.Tensor, L: dict[str, Any], ops: TorchOps) -> None:
        """Qwen3 / Gemma 3: per-head RMSNorm of q and k before RoPE, in place. Llama: nothing."""

    def attention(self, r, li: int, L: dict[str, Any], h: torch.Tensor, batch, ops: TorchOps) -> torch.Tensor:
        """Projections, RoPE + K/V write, attention over the pool, output projection."""
        T, H, KV, D = h.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = self.proj(r, h, L, "qkv", li, batch)
        self.qk_norm(qkv, L, ops)
        cos, sin = r.rope[li]
        ops.rope_write_kv(qkv, cos, sin, batch, r.k_cache[li], r.v_cache[li], H, KV)
        q = qkv[:, :H * D].view(T, H, D)
        scale = self.q_scale()
        if scale != 1.0:
            q = q * scale
        return self.proj(r, r.attention(li, q, batch), L, "o", li, batch)

    def mlp(self, r, li: int, L: dict[str, Any], h: torch.Tensor, batch, ops: TorchOps) -> torch.Tensor:
        return self.proj(r, ops.act_mul(self.proj(r, h, L, "gate_up", li, batch), self.act), L, "down", li, batch)

    def forward(self, r, batch, ops: TorchOps) -> torch.Tensor:
        """Logits for batch.logits_rows. Pre-norm blocks; the residual stream x is updated in place."""
        x = self.embed_tokens(batch.input_ids)
        h = ops.rms_norm(x, self.layers[0]["in_norm"])
        for li, L in enumerate(self.layers):
            h = ops.add_rms_norm(x, self.attention(r, li, L, h, batch, ops), L["post_norm"])
            down = self.mlp(r, li, L, h, batch, ops)
            if li + 1 < self.n_layers:
                h = ops.add_rms_norm(x, down, self.layers[li + 1]["in_norm"])
            else:
                x.add_(down)
        return self.logits(r, x.index_select(0, batch.logits_rows), ops)

    def logits(self, r, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return softcap(r.mm(ops.rms_norm(x, self.final_norm), self.lm_head), self.final_softcap)


class QKNormed:
    """Mixin for families with per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3): loads the two norm
    weights through the family's own norm_weight (Gemma's 1 + w) and applies them in place."""

    def load_layer(self, p: str, w: dict[str, torch.Tensor], get: Getter, linear: Getter) -> dict[str, Any]:
        L = super().load_layer(p, w, get, linear)
        L["q_norm"] = self.norm_weight(get(p + "self_attn.q_norm.weight"))
        L["k_norm"] = self.norm_weight(get(p + "self_attn.k_norm.weight"))
        return L

    def qk_norm(self, qkv: torch.Tensor, L: dict[str, Any], ops: TorchOps) -> None:
        head_norm(qkv, L["q_norm"], L["k_norm"], self.n_heads, self.n_kv, self.eps)
