"""Rotary position tables (cos, sin) for a config: default, linear, and Llama-3's `rope_scaling` (rope_type llama3).

Computed in fp32 and cast, as transformers does, so fp32 runs match it. Llama-3.x checkpoints rescale the low
frequencies (long wavelengths) by `factor` and blend the band between low_freq_factor and high_freq_factor;
without that, real Llama-3.1/3.2 weights would produce wrong outputs past short contexts.
"""
from __future__ import annotations

import math

import torch


def _scaling(cfg: dict) -> dict:
    rs = cfg.get("rope_scaling") or {}
    rp = cfg.get("rope_parameters") or {}      # transformers 5 folds rope_theta and scaling into one dict
    if rp.get("rope_type") not in (None, "default") and not rs:
        rs = rp
    return rs


def rope_theta(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0))


def inverse_frequencies(cfg: dict, head_dim: int) -> torch.Tensor:
    theta = rope_theta(cfg)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rs = _scaling(cfg)
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return inv_freq
    factor = float(rs["factor"])
    if kind == "linear":                      # position interpolation (Gemma 3's global layers at 4B and up)
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3, linear)")
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: dict, head_dim: int, positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [positions, head_dim] (the half-dim frequencies repeated, HF's rotate_half layout)."""
    inv_freq = inverse_frequencies(cfg, head_dim)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
