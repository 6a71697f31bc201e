"""Paged attention for CUDA: one Triton kernel reads K/V straight from the pool's blocks (no gather copy) for
every token of a step - decode rows and prefill chunks alike, so a step makes one attention call per layer.

Each program handles one query token and one KV head: it loads the token's GQA group of query heads, walks
the token's sequence's block table up to its own position (causal: a token sees keys 0..pos, its chunk's new
keys included because they are written to the pool first) in tiles of BLOCK_N keys, and keeps an online
softmax in fp32. Products are plain fp32 multiply-adds (no tensor-core dot), so fp32 runs stay exact enough to
reproduce transformers' greedy ids; decode attention is memory-bound anyway.

Pool layout (shared with the CPU path): per layer [kv_heads, slots, head_dim], slot = block * block_size + i.
Triton is imported lazily: CPU installs never need it.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:        # CPU-only installs: the CUDA path is never taken there
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def _paged_attention_kernel(Q, K, V, O, BT, SEQ, POS, scale,
                                stride_qt, stride_qh, stride_kh, stride_ot, stride_oh, stride_bt,
                                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                BLOCK_N: tl.constexpr):
        t = tl.program_id(0)
        g = tl.program_id(1)
        row = tl.load(SEQ + t)
        ctx = tl.load(POS + t) + 1
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        heads = g * G + offs_g
        q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32) * scale
        m = tl.full([GP], float("-inf"), tl.float32)
        denom = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        kbase = K + g * stride_kh
        vbase = V + g * stride_kh
        for start in range(0, ctx, BLOCK_N):
            n = start + offs_n
            nmask = n < ctx
            blk = tl.load(BT + row * stride_bt + n // BS, mask=nmask, other=0)
            slot = blk.to(tl.int64) * BS + n % BS
            k = tl.load(kbase + slot[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                 # [GP, BLOCK_N]
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            v = tl.load(vbase + slot[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        tl.store(O + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=gmask[:, None])


def available() -> bool:
    return triton is not None


def paged_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, block_tables: torch.Tensor,
                    tok_seq: torch.Tensor, positions: torch.Tensor, block_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]; k_layer/v_layer [KV, slots, D]; block_tables [S, max_blocks]; tok_seq/positions [T]
    (token t belongs to block-table row tok_seq[t] and sits at positions[t]). Returns [T, H, D]."""
    if triton is None:
        raise RuntimeError("paged_attention needs triton (CUDA installs)")
    T, H, D = q.shape
    KV = k_layer.shape[0]
    G = H // KV
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    GP = max(2, triton.next_power_of_2(G))
    block_n = 32 if GP <= 4 else 16
    _paged_attention_kernel[(T, KV)](
        q, k_layer, v_layer, out, block_tables, tok_seq, positions, D ** -0.5,
        q.stride(0), q.stride(1), k_layer.stride(0), out.stride(0), out.stride(1), block_tables.stride(0),
        G=G, GP=GP, D=D, BS=block_size, BLOCK_N=block_n, num_warps=4)
    return out


def reference_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, block_tables: torch.Tensor,
                        tok_seq: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The same function in plain torch, token by token (tests only)."""
    T, H, D = q.shape
    KV = k_layer.shape[0]
    out = torch.empty_like(q)
    for t in range(T):
        ctx = int(positions[t]) + 1
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[int(tok_seq[t])][pos // block_size] * block_size + pos % block_size
        k = k_layer[:, slots].float().repeat_interleave(H // KV, 0)        # [H, ctx, D]
        v = v_layer[:, slots].float().repeat_interleave(H // KV, 0)
        s = torch.einsum("hd,hnd->hn", q[t].float(), k) * D ** -0.5
        out[t] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v).to(q.dtype)
    return out
