"""Decode attention on the CPU: one query per sequence over its gathered K/V blocks, two ways, and the choice
between them made by measuring on this machine.

- "sdpa": torch's fused scaled_dot_product_attention (CPU flash attention) with the length mask;
- "matmul": grouped-query batched matmuls, the scores softmaxed in fp32.

Which is faster depends on the CPU, the dtype and the number of rows, by an order of magnitude either way: on a
2-core AVX512-BF16 Xeon, SDPA was 3-4x faster at 1-32 rows; on a 2-core AVX512-BF16 EPYC (Zen 4 class) bf16
SDPA took 3.3 ms for 32 rows x 256 keys x 9 heads and the matmul pair 0.25 ms (30 layers: ~100 ms of a ~130 ms
step), while for one row SDPA is 4x faster there (24 vs 96 us per layer: the matmul path is ~10 small ops).
So `auto` times both once at start (`choose`), as an autotuner would, for few rows (one stream) and for many
(a batch), and keeps the faster one of each.

Accuracy (32 rows, 256 keys, bf16, relative L2 error vs fp32): SDPA 1.9e-3, matmul 7.1e-3 (its scores are
rounded to bf16 before the fp32 softmax); tests/engine/test_engine_numerics.py bounds the end-to-end effect.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from python_backends.engine.device import fastest
from python_backends.engine.models.layers import softcap

log = logging.getLogger(__name__)
DECODE_ATTENTIONS = ("auto", "sdpa", "matmul")


def decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; k, v [KV, B, L, D]; mask [B, 1, 1, L] (True = attend) -> [B, H*D].

    The H // KV query heads that share a K/V head go in as the query rows of one attention over that head
    (GQA as a [KV, B, G, D] query, not SDPA's enable_gqa with one query row per head): the same products,
    and CPU flash attention parallelises over B x KV with G rows each instead of B x H with one. 32 rows x 80
    keys x 9 heads, bf16, 2-core Xeon (AMX): 0.11 vs 0.29 ms; 256 keys 0.41 vs 0.52 ms; 1 row 13 vs 21 us."""
    B, H, D = q.shape
    KV = k.shape[0]
    qg = q.view(B, KV, H // KV, D).transpose(0, 1)                        # [KV, B, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.view(1, B, 1, -1))
    return out.transpose(0, 1).reshape(B, H * D)


def decode_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Same contract as decode_sdpa: the H // KV query heads sharing a K/V head are one matrix of rows."""
    B, H, D = q.shape
    KV = k.shape[0]
    qg = q.view(B, KV, H // KV, D).transpose(0, 1)                       # [KV, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()               # [KV, B, G, L]
    scores.mul_(D ** -0.5).masked_fill_(~mask.view(1, B, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(B, H * D)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     cap: float | None) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, KV, L, D], mask broadcastable to [B, H, n, L] (True = attend) -> [B, H, n, D].
    Eager attention as transformers computes it for sliding-window and soft-capped models (Gemma 2): scores
    * D**-0.5, tanh soft-cap, mask, fp32 softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


IMPLEMENTATIONS = {"sdpa": decode_sdpa, "matmul": decode_matmul}
FEW_ROWS = 4          # decode groups of at most this many rows use the few-row choice


class DecodeAttention:
    """The decode attention chosen for groups of at most FEW_ROWS rows (`few`) and for larger ones (`many`)."""

    def __init__(self, few: str, many: str):
        self.few, self.many = few, many
        self._few, self._many = IMPLEMENTATIONS[few], IMPLEMENTATIONS[many]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self._few if q.shape[0] <= FEW_ROWS else self._many)(q, k, v, mask)


def group_by_length(blocks: list[int], min_saving: int = 64, max_groups: int = 3) -> list[list[int]]:
    """Decode rows (their context lengths in blocks) split into at most `max_groups` groups of similar
    length, longest first, each gathered and attended padded only to its own longest row. The gather and the
    attention cost ~ rows x padded blocks, a group ~6 ops per layer more: a split is made only where it saves
    at least `min_saving` row-blocks (at ~0.12 ms per row-block per step on a 2-core Xeon, ~8 ms: a
    group's fixed cost). Rows of equal length (a burst) stay one group, in batch order (nothing to reorder)."""
    order = sorted(range(len(blocks)), key=lambda r: -blocks[r])
    b = [blocks[r] for r in order]

    def best_split(lo: int, hi: int) -> tuple[int, int]:
        saving, at = 0, 0
        for i in range(lo + 1, hi):
            gain = (hi - i) * (b[lo] - b[i])      # rows i.. padded to b[i] instead of b[lo]
            if gain > saving:
                saving, at = gain, i
        return saving, at

    segments = [(0, len(b))]
    while len(segments) < max_groups:
        (saving, at), seg = max(((best_split(lo, hi), (lo, hi)) for lo, hi in segments), key=lambda c: c[0][0])
        if saving < min_saving:
            break
        segments.remove(seg)
        segments += [(seg[0], at), (at, seg[1])]
    if len(segments) == 1:
        return [list(range(len(blocks)))]
    return [order[lo:hi] for lo, hi in sorted(segments)]


def choose(setting: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
           device: torch.device = torch.device("cpu"), rows: int = 16, keys: int = 256,
           repeats: int = 5) -> DecodeAttention:
    """The decode attention to use: `setting` itself for every group, or for `auto` the faster of the two on a
    representative CPU step - one row (a lone stream) and `rows` rows (a batch), `keys` keys each - best of
    `repeats` timed calls each, interleaved so that a burst of load on the machine hits both alike. On CUDA
    (the gather path, where the paged kernel is unavailable) `auto` is SDPA, whose fused kernels win there."""
    if setting not in DECODE_ATTENTIONS:
        raise ValueError(f"cpu_decode_attention {setting!r}: allowed are {', '.join(DECODE_ATTENTIONS)}")
    if setting != "auto":
        return DecodeAttention(setting, setting)
    if device.type != "cpu":
        return DecodeAttention("sdpa", "sdpa")
    few, few_times = _fastest(dtype, heads, kv_heads, head_dim, 1, keys, repeats)
    many, many_times = _fastest(dtype, heads, kv_heads, head_dim, rows, keys, repeats)
    log.info("CPU decode attention: %s for <= %d rows, %s above (%s, %d keys; 1 row: %s; %d rows: %s)", few,
             FEW_ROWS, many, dtype, keys, few_times, rows, many_times)
    return DecodeAttention(few, many)


def _fastest(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, rows: int, keys: int,
             repeats: int) -> tuple[str, str]:
    """(name of the faster implementation, both timings as text) for `rows` rows x `keys` keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(kv_heads, rows, keys, head_dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, rows, keys, head_dim, generator=gen).to(dtype)
    mask = (torch.arange(keys).unsqueeze(0) < torch.randint(keys // 2, keys + 1, (rows, 1), generator=gen))
    mask = mask.view(rows, 1, 1, keys)
    with torch.inference_mode():
        best = fastest({name: (lambda fn=fn: fn(q, k, v, mask)) for name, fn in IMPLEMENTATIONS.items()}, repeats)
    return min(best, key=best.get), ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in best.items())
