"""Paged attention for CUDA: one Triton kernel reads K/V straight from the pool's blocks (no gather copy) for
every token of a step - decode rows and prefill chunks alike, so a step makes one attention call per layer.

Each program handles one query token and one KV head: it loads the token's GQA group of query heads (padded
to 16 rows so the products run as tensor-core dots), walks the token's sequence's block table up to its own
position (causal: a token sees keys 0..pos, its chunk's new keys included because they are written to the pool
first) in tiles of BLOCK_N keys, and keeps an online softmax in fp32. fp32 models use IEEE fp32 dots (no TF32),
so fp32 runs reproduce transformers' greedy ids. A plain multiply-add variant of the same kernel is kept as the
fallback should the dot variant fail to compile on some GPU.

Pool layout (shared with the CPU path): per layer [kv_heads, slots, head_dim], slot = block * block_size + i.
Triton is imported lazily: CPU installs never need it.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_use_dot = True

try:                       # CUDA images carry Triton; CPU installs normally do not (then the CPU path serves)
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

if triton is not None:
    @triton.jit
    def _load_queries(Q, SEQ, POS, stride_qt, stride_qh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
        """This program's token and KV head: its block-table row, context length, GQA group of query heads."""
        t = tl.program_id(0)
        g = tl.program_id(1)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        heads = g * G + offs_g
        q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        return t, g, tl.load(SEQ + t), tl.load(POS + t) + 1, heads, gmask, offs_d, q

    @triton.jit
    def _empty_state(GP: tl.constexpr, D: tl.constexpr):
        """Running max, softmax denominator and weighted sum of values, per query head of the group."""
        return tl.full([GP], float("-inf"), tl.float32), tl.zeros([GP], tl.float32), tl.zeros([GP, D], tl.float32)

    @triton.jit
    def _tile_offsets(BT, row, stride_bt, start, ctx, head_offset, offs_d, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                      D: tl.constexpr):
        """Element offsets (in this layer's K or V) of keys start..start+BLOCK_N-1 of the sequence, found
        through its block table, and their mask."""
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < ctx
        blk = tl.load(BT + row * stride_bt + n // BS, mask=nmask, other=0)
        slot = blk.to(tl.int64) * BS + n % BS
        return head_offset + slot[:, None] * D + offs_d[None, :], nmask

    @triton.jit
    def _softmax_step(s, nmask, m, denom):
        """Online softmax: fold one tile of scores in; returns the tile's weights, the rescale of the old sum."""
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)

    @triton.jit(do_not_specialize=["stride_bt"])
    def _paged_attention_kernel(Q, K, V, O, BT, SEQ, POS, scale,
                                stride_qt, stride_qh, stride_kh, stride_ot, stride_oh, stride_bt,
                                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                BLOCK_N: tl.constexpr):
        t, g, row, ctx, heads, gmask, offs_d, q = _load_queries(Q, SEQ, POS, stride_qt, stride_qh, G, GP, D)
        q = q.to(tl.float32) * scale
        m, denom, acc = _empty_state(GP, D)
        for start in range(0, ctx, BLOCK_N):
            kv, nmask = _tile_offsets(BT, row, stride_bt, start, ctx, g * stride_kh, offs_d, BS, BLOCK_N, D)
            k = tl.load(K + kv, mask=nmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                 # [GP, BLOCK_N]
            p, alpha, m, denom = _softmax_step(s, nmask, m, denom)
            v = tl.load(V + kv, mask=nmask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        out = acc / denom[:, None]
        tl.store(O + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=gmask[:, None])

    @triton.jit(do_not_specialize=["stride_bt"])
    def _paged_attention_dot_kernel(Q, K, V, O, BT, SEQ, POS, scale,
                                    stride_qt, stride_qh, stride_kh, stride_ot, stride_oh, stride_bt,
                                    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                                    BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        t, g, row, ctx, heads, gmask, offs_d, q = _load_queries(Q, SEQ, POS, stride_qt, stride_qh, G, GP, D)
        m, denom, acc = _empty_state(GP, D)
        for start in range(0, ctx, BLOCK_N):
            kv, nmask = _tile_offsets(BT, row, stride_bt, start, ctx, g * stride_kh, offs_d, BS, BLOCK_N, D)
            k = tl.load(K + kv, mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale          # [GP, BLOCK_N] fp32
            p, alpha, m, denom = _softmax_step(s, nmask, m, denom)
            v = tl.load(V + kv, mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
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
    args = (q, k_layer, v_layer, out, block_tables, tok_seq, positions, D ** -0.5,
            q.stride(0), q.stride(1), k_layer.stride(0), out.stride(0), out.stride(1), block_tables.stride(0))
    global _use_dot
    if _use_dot:
        try:
            _paged_attention_dot_kernel[(T, KV)](
                *args, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=block_size, BLOCK_N=64,
                PREC="ieee" if q.dtype == torch.float32 else None, num_warps=4, num_stages=2)
            return out
        except Exception:            # compile failure on this GPU/toolchain: the multiply-add kernel still works
            log.exception("paged attention: tensor-core variant failed; using the multiply-add kernel")
            _use_dot = False
    GP = max(2, triton.next_power_of_2(G))
    _paged_attention_kernel[(T, KV)](*args, G=G, GP=GP, D=D, BS=block_size, BLOCK_N=32 if GP <= 4 else 16,
                                     num_warps=4)
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
