"""The layers every model family is composed of: RMSNorm, RoPE with the K/V write, gated MLP activations,
soft-capping, and biased projections, each in two interchangeable implementations.

`TorchOps` is plain torch (CPU or CUDA); `KernelOps` uses the fused CPU kernels (cpu_kernels.py) where they
cover the operation (SiLU-gated MLP, RMSNorm, residual add + RMSNorm, RoPE + K/V write) and the torch op where
they do not (GELU-gated MLPs fall back to torch). Both round as transformers does in fp32, so a family file
writes its forward once against `ops` and runs with the kernels on or off.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,                                              # erf GELU (transformers' GELUActivation)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in fp32, cast back, then scale (Gemma's (1 + w) is folded into w at load)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's layout: the two halves of each head are the pairs)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap (Gemma 2's logit and attention soft-capping); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class TorchOps:
    """The step's elementwise layers in torch ops."""

    def __init__(self, eps: float):
        self.eps = eps

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w, self.eps)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x += y in place (the residual stream), then RMSNorm(x) * w."""
        x.add_(y)
        return rms_norm(x, w, self.eps)

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, heads: int, kv_heads: int) -> None:
        """Rotate q and k of qkv [T, (H + 2KV) * D] in place; write the step's K and V at its slots."""
        T, D = qkv.shape[0], cos.shape[-1]
        c = cos.index_select(0, batch.positions).unsqueeze(1)
        s = sin.index_select(0, batch.positions).unsqueeze(1)
        qk = qkv[:, :(heads + kv_heads) * D]
        qk.copy_(rotate(qk.view(T, heads + kv_heads, D), c, s).view(T, -1))
        k = qk.view(T, heads + kv_heads, D)[:, heads:]
        v = qkv[:, (heads + kv_heads) * D:].view(T, kv_heads, D)
        k_cache.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))

    def act_mul(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up for gu = [gate | up] (one fused projection)."""
        inter = gu.shape[-1] // 2
        return ACTIVATIONS[act](gu[:, :inter]) * gu[:, inter:]


class KernelOps(TorchOps):
    """The same layers through the fused CPU kernels where they exist for the operation."""

    def __init__(self, eps: float, kernels: ModuleType):
        super().__init__(eps)
        self.k = kernels

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.k.rms_norm(x, w, self.eps) if x.is_contiguous() else super().rms_norm(x, w)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.k.add_rms_norm(x, y.contiguous(), w, self.eps)

    def rope_write_kv(self, qkv, cos, sin, batch, k_cache, v_cache, heads, kv_heads) -> None:
        self.k.rope_write_kv(qkv, cos, sin, batch.positions, k_cache, v_cache, batch.slot_mapping, heads, kv_heads)

    def act_mul(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        # the kernel is SiLU only; GELU-gated MLPs (Gemma, gelu Llamas) use the torch ops
        return self.k.silu_mul(gu) if act == "silu" else super().act_mul(gu, act)


def head_norm(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, heads: int, kv_heads: int,
              eps: float) -> None:
    """Per-head RMSNorm of q and k inside qkv [T, (H + 2KV) * D], in place (Qwen3, Gemma 3: before RoPE)."""
    T, D = qkv.shape[0], q_w.shape[0]
    q, k = qkv[:, :heads * D], qkv[:, heads * D:(heads + kv_heads) * D]
    q.copy_(rms_norm(q.reshape(T, heads, D), q_w, eps).view(T, heads * D))
    k.copy_(rms_norm(k.reshape(T, kv_heads, D), k_w, eps).view(T, kv_heads * D))
