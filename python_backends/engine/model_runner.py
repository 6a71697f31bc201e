"""Our own Llama forward in torch, reading attention K/V through block tables from one paged KV pool.

One step runs one flattened batch: all tokens of the step (decode tokens of running sequences, then prompt
chunks) go through the dense layers together as a [T, hidden] matrix; only attention is grouped: every
decode row attends to its own gathered K/V in one batched SDPA call with a padding mask, and each prompt
chunk attends causally to its sequence's cached prefix plus itself. New K/V are written into the pool at
the slots the block tables name before attention reads them, so a chunk sees its own keys.

The pool is `[layers, kv_heads, slots, head_dim]` for K and for V (head-major), slots = blocks * block_size:
gathering a sequence's blocks then yields `[kv_heads, tokens, head_dim]` contiguous, which batched matmuls read
as is (a slot-major layout costs a transposing copy per layer that is as large as the gather). Block 0 is a
reserved zero block: padding in gathers points at it, so masked positions never read uninitialised memory
(0 * NaN would poison softmax output). The pool is allocated with torch.empty so untouched pages never
become resident: RSS follows the blocks actually used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from python_backends.engine.lora import LoraManager

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions start..start+len-1."""
    token_ids: list[int]
    start: int
    block_table: list[int]
    need_logits: bool
    lora_slot: int = -1          # -1 = base model


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    n_decode: int
    decode_gather: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    logits_rows: torch.Tensor | None = None
    lora_rows: torch.Tensor | None = None


class ModelRunner:
    """Loads HF Llama safetensors and runs paged forwards; owns the KV pool tensors."""

    def __init__(self, weights_dir: Path, dtype: str, num_blocks: int, block_size: int, max_context: int,
                 lora: LoraManager | None = None, fp32_matmul_min_tokens: int = 16):
        cfg = json.loads((weights_dir / "config.json").read_text())
        self.dtype = DTYPES[dtype]
        self.n_layers = cfg["num_hidden_layers"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg["num_key_value_heads"]
        self.hidden = cfg["hidden_size"]
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        self.eps = cfg["rms_norm_eps"]
        self.vocab = cfg["vocab_size"]
        self.block_size = block_size
        self.num_blocks = num_blocks
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        gen = weights_dir / "generation_config.json"
        if gen.exists():
            geos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_ids |= set(geos if isinstance(geos, list) else [geos] if geos is not None else [])
        self.lora = lora
        self._load(weights_dir, cfg.get("tie_word_embeddings", False))
        # These CPUs have no bf16 matmul units: oneDNN's bf16 GEMM runs at about half the fp32 rate once a step
        # has many rows (prefill chunks), while for a few rows (decode) bf16 wins by reading half the bytes.
        # So bf16 mode keeps fp32 copies of the weights (the values are the same: upcasting is exact) and uses
        # them for steps of >= fp32_matmul_min_tokens rows; activations, KV cache and outputs stay bf16.
        self.min_rows_fp32 = fp32_matmul_min_tokens if self.dtype == torch.bfloat16 and fp32_matmul_min_tokens else 0
        self.w32: dict[int, torch.Tensor] = {}
        if self.min_rows_fp32:
            for L in self.layers:
                for key in ("qkv", "o", "gate_up", "down"):
                    self.w32[id(L[key])] = L[key].float()
            self.w32[id(self.lm_head)] = self.lm_head.float()
        # RoPE tables computed in fp32 and cast, as transformers does, so fp32 runs match it bit for bit-ish.
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        t = torch.arange(max_context + block_size, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        slots = num_blocks * block_size
        self.k_cache = torch.empty(self.n_layers, self.n_kv, slots, self.head_dim, dtype=self.dtype)
        self.v_cache = torch.empty(self.n_layers, self.n_kv, slots, self.head_dim, dtype=self.dtype)
        self.k_cache[:, :, :block_size].zero_()
        self.v_cache[:, :, :block_size].zero_()

    def _load(self, weights_dir: Path, tied: bool) -> None:
        w = load_file(str(weights_dir / "model.safetensors"))
        w = {k: v.to(self.dtype) for k, v in w.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if tied or "lm_head.weight" not in w else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "in_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                # Fused projections: one matmul instead of three (two), fewer dispatches per layer.
                "qkv": torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                                  w[p + "self_attn.v_proj.weight"]]).contiguous(),
                "o": w[p + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).contiguous(),
                "down": w[p + "mlp.down_proj.weight"],
            })

    # ------------------------------------------------------------------ batch preparation
    def prepare(self, chunks: list[SeqChunk]) -> ForwardBatch:
        """Flatten a step's chunks: decode chunks (one token, start > 0) must come first."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lora_rows: list[int] = []
        logits_rows: list[int] = []
        n_decode = 0
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        prefills = []
        for c in chunks:
            n = len(c.token_ids)
            t0 = len(ids)
            ids.extend(c.token_ids)
            positions = range(c.start, c.start + n)
            pos.extend(positions)
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in positions)
            lora_rows.extend([c.lora_slot] * n)
            if c.need_logits:
                logits_rows.append(t0 + n - 1)
            ctx = c.start + n
            if n == 1 and c.start > 0 and not prefills:
                n_decode += 1
                decode_lens.append(ctx)
                decode_tables.append(c.block_table)
            elif c.start == 0:
                prefills.append((t0, n, ctx, None, None))   # fresh prompt: plain causal attention
            else:
                gather = self._blocks(c.block_table, ctx)
                q_pos = torch.arange(c.start, ctx).unsqueeze(1)
                # [n, blocks*bs]: causal with an offset; the tail of the last block is masked out too
                mask = torch.arange(gather.shape[0] * bs).unsqueeze(0) <= q_pos
                prefills.append((t0, n, ctx, gather, mask))
        decode_gather = decode_mask = None
        if n_decode:
            # Gather whole blocks (contiguous block_size*kv*d rows), not single slots: far fewer, larger copies.
            nbmax = -(-max(decode_lens) // bs)
            decode_gather = torch.zeros(n_decode, nbmax, dtype=torch.long)
            for r, (table, ln) in enumerate(zip(decode_tables, decode_lens)):
                nb = -(-ln // bs)
                decode_gather[r, :nb] = torch.tensor(table[:nb], dtype=torch.long)
            lens = torch.tensor(decode_lens)
            decode_mask = (torch.arange(nbmax * bs).unsqueeze(0) < lens.unsqueeze(1)).view(1, n_decode, 1, -1)
        lr = torch.tensor(lora_rows, dtype=torch.long)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long), n_decode=n_decode, decode_gather=decode_gather,
            decode_mask=decode_mask, prefills=prefills, logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            lora_rows=lr if bool((lr >= 0).any()) else None)

    def _blocks(self, table: list[int], length: int) -> torch.Tensor:
        return torch.tensor(table[:-(-length // self.block_size)], dtype=torch.long)

    # ------------------------------------------------------------------ forward
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.min_rows_fp32 and x.shape[0] >= self.min_rows_fp32:
            return F.linear(x.float(), self.w32[id(w)]).to(x.dtype)
        return F.linear(x, w)

    def _lin(self, x: torch.Tensor, w: torch.Tensor, layer: int, name: str, batch: ForwardBatch) -> torch.Tensor:
        y = self._mm(x, w)
        if batch.lora_rows is not None and self.lora is not None:
            y = self.lora.apply(y, x, layer, name, batch.lora_rows)
        return y

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per row: plain batched matmuls. CPU flash attention is built for long queries and is ~10x
        slower here. q [B, H, D]; k, v [KV, B, L, D]; mask [1, B, 1, L] (True = attend)."""
        B, H, D = q.shape
        KV = k.shape[0]
        qg = q.view(B, KV, H // KV, D).transpose(0, 1)                   # [KV, B, G, D]: G heads share K/V
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (D ** -0.5)   # [KV, B, G, L]
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(B, H * D)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns fp32 logits for batch.logits_rows, in order."""
        T = batch.input_ids.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(batch.input_ids, self.embed)
        cos = self.cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self.sin.index_select(0, batch.positions).unsqueeze(1)
        nd = batch.n_decode
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["in_norm"])
            qkv = self._lin(h, L["qkv"], li, "qkv", batch)
            qk = self._rope(qkv[:, :(H + KV) * D].view(T, H + KV, D), cos, sin)   # q and k in one pass
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KV) * D:].view(T, KV, D)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
            vc.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
            # [kv, blocks, block_size*d] views: index_select copies whole block rows (memcpy); advanced
            # indexing is ~30x slower on CPU.
            kb, vb = kc.view(KV, self.num_blocks, -1), vc.view(KV, self.num_blocks, -1)
            outs = []
            if nd:
                g = batch.decode_gather
                kd = kb.index_select(1, g.view(-1)).view(KV, nd, -1, D)   # [KV, Bd, L, D], contiguous
                vd = vb.index_select(1, g.view(-1)).view(KV, nd, -1, D)
                outs.append(self._decode_attention(q[:nd], kd, vd, batch.decode_mask))
            for t0, n, ctx, gather, mask in batch.prefills:
                qp = q[t0:t0 + n].transpose(0, 1).unsqueeze(0)        # [1, H, n, D]
                if gather is None:
                    kp = k[t0:t0 + n].transpose(0, 1).unsqueeze(0)
                    vp = v[t0:t0 + n].transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                else:
                    kp = kb.index_select(1, gather).view(1, KV, -1, D)
                    vp = vb.index_select(1, gather).view(1, KV, -1, D)
                    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
                outs.append(op[0].transpose(0, 1).reshape(n, H * D))
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = x + self._lin(attn, L["o"], li, "o", batch)
            h = self._rms(x, L["post_norm"])
            gu = self._lin(h, L["gate_up"], li, "gate_up", batch)
            inter = gu.shape[-1] // 2
            x = x + self._lin(F.silu(gu[:, :inter]) * gu[:, inter:], L["down"], li, "down", batch)
        x = x.index_select(0, batch.logits_rows)
        x = self._rms(x, self.final_norm)
        return self._mm(x, self.lm_head).float()
