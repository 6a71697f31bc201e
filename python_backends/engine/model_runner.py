"""Runs a model family's forward (models/: Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3) in torch, on the CPU or a
CUDA device, reading attention K/V from one paged KV pool. The family file owns the weights and the block; the
runner owns the batch metadata, the KV pool, the GEMM packing and the attention.

One step runs one flattened batch: all tokens of the step (decode tokens of running sequences, then prompt
chunks) go through the dense layers together as a [T, hidden] matrix. New K/V are written into the pool at the
slots the block tables name before attention reads them, so a chunk sees its own keys. Attention:
- CUDA: one paged-attention Triton kernel per layer for every token of the step (paged_attention.py), reading
  blocks in place; decode-only steps replay a CUDA graph captured per batch-size bucket (cuda_graphs.py).
- CPU: decode rows attend to their blocks gathered whole (one index_select per layer of contiguous block rows
  into a reused buffer) in one call per group of similar context length (at most 3; usually one); all
  prefill chunks of the step go through ONE SDPA call over their gathered blocks with a block-diagonal
  causal mask.

The step's metadata (ids, positions, slots, block tables, ...) is packed into one int64 vector and moved in one
pinned non-blocking copy (device.Staging). The pool is `[layers, kv_heads, slots, head_dim]` for K and for V
(head-major): a block of one head is a contiguous block_size*head_dim run. Block 0 is a reserved zero block
(CPU gathers pad with it, so masked positions never read uninitialised memory: 0 * NaN would poison softmax);
one extra block past the managed ones is the scratch block that padded CUDA-graph rows write to.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from python_backends.engine import cpu_attention, cpu_kernels, paged_attention
from python_backends.engine.batch import DecodeGroup, ForwardBatch, SeqChunk
from python_backends.engine.device import (PackedLinear, Staging, choose_bf16_gemm, cpu_matmul_kind,
                                           kv_blocks_for_memory)
from python_backends.engine.lora import LoraManager
from python_backends.engine.models import model_for
from python_backends.engine.models.layers import KernelOps, TorchOps

log = logging.getLogger(__name__)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def precision(dtype: str, cpu_matmul: str, device: torch.device) -> tuple[str, torch.dtype]:
    """(CPU GEMM kind, compute dtype) for weights of `dtype`: the kind from device.cpu_matmul_kind; activations,
    norms, LoRA buffers and the KV pool are fp32 where that kind multiplies in fp32, else in `dtype`."""
    matmul = cpu_matmul_kind(cpu_matmul, DTYPES[dtype], device)
    return matmul, torch.float32 if matmul in ("fp16", "fp32") else DTYPES[dtype]


def read_model_config(weights_dir: Path) -> dict:
    cfg = json.loads((weights_dir / "config.json").read_text())
    # multimodal wrappers keep the text model's fields in text_config (the allow-list then names the wrapper)
    return dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})


def load_checkpoint(weights_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards a `model.safetensors.index.json` names (model-0000x-of-0000y)."""
    single = weights_dir / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = weights_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in weights_dir.glob("model-*-of-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{weights_dir} has neither model.safetensors nor model-*-of-*.safetensors shards")
    weights: dict[str, torch.Tensor] = {}
    for name in shards:
        weights.update(load_file(str(weights_dir / name)))
    return weights


class ModelRunner:
    """Loads HF safetensors of a supported family onto the device and runs paged forwards; owns the KV pool."""

    def __init__(self, weights_dir: Path, dtype: str, num_blocks: int, block_size: int, max_context: int,
                 lora: LoraManager | None = None, cpu_matmul: str = "auto",
                 device: torch.device | str = "cpu", state_dict: dict[str, torch.Tensor] | None = None,
                 kv_memory_fraction: float = 0.85, cpu_decode_attention: str = "auto",
                 cpu_kernels_setting: str = "auto", cpu_bf16_gemm: str = "auto", decode_rows: int = 32):
        """num_blocks 0 = as many as kv_memory_fraction of the free memory holds; state_dict replaces
        model.safetensors (benchmarks on random weights); cpu_kernels_setting: auto | on | off (cpu_kernels.py);
        cpu_bf16_gemm: auto | kernel | onednn, timed for 1 and `decode_rows` rows (device.choose_bf16_gemm)."""
        cfg = read_model_config(weights_dir)
        self.model = model_for(cfg)          # the family; support.UnsupportedModel names a config field it lacks
        self.device = torch.device(device)
        # dtype names the weights' precision; self.dtype is the compute dtype (see precision)
        self.matmul, self.dtype = precision(dtype, cpu_matmul, self.device)
        m = self.model
        self.n_layers, self.n_heads, self.n_kv, self.hidden = m.n_layers, m.n_heads, m.n_kv, m.hidden
        self.head_dim, self.eps = m.head_dim, m.eps
        self.vocab = cfg["vocab_size"]
        # per layer: the sliding window (None = all keys) and the attention logit soft-cap; either needs the
        # masked torch attention (CPU only: the CUDA kernel and the CPU decode kernel implement neither)
        self.windows = [m.window(li, max_context) for li in range(self.n_layers)]
        self.attn_softcap = m.attn_softcap()
        self.masked = [w is not None or self.attn_softcap is not None for w in self.windows]
        if any(self.masked) and self.device.type == "cuda":
            arch = cfg.get("architectures") or cfg.get("model_type")
            why = (f"attn_logit_softcapping={self.attn_softcap}" if self.attn_softcap is not None else
                   f"sliding_window={cfg.get('sliding_window')} below max_context {max_context}")
            raise ValueError(f"{arch}: {why} is not implemented by the CUDA paged attention; serve it on the CPU"
                             + ("" if self.attn_softcap is not None else ", or with max_context <= sliding_window"))
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_context // block_size)
        eos = cfg.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        gen = weights_dir / "generation_config.json"
        if gen.exists():
            geos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_ids |= set(geos if isinstance(geos, list) else [geos] if geos is not None else [])
        self.lora = lora
        self._load(state_dict if state_dict is not None else load_checkpoint(weights_dir), DTYPES[dtype])
        # CPU: fused kernels (norms, RoPE + K/V write, SiLU * up, bf16 GEMMs where they win) and, unless a torch
        # decode attention is named, decode attention reading the pool in place; without them (or on CUDA) torch ops
        self.kernels = cpu_kernels.resolve(cpu_kernels_setting, self.device)
        self.ops = KernelOps(self.eps, self.kernels) if self.kernels is not None else TorchOps(self.eps)
        sample = self.layers[0]["gate_up"] if self.matmul in ("bf16", "int8") else None
        bf16_gemm = choose_bf16_gemm(cpu_bf16_gemm, self.kernels, sample, min(max(decode_rows, 1), 64))
        self.gemm = self.kernels if bf16_gemm == "kernel" else None
        for L in self.layers:
            for key in m.LINEARS:
                L[key] = self._prepare_linear(L[key])
        m.lm_head = self._prepare_linear(m.lm_head)
        # The pool comes last: sized from what is free once weights (and fp32 copies) are resident.
        self.num_blocks = num_blocks or kv_blocks_for_memory(kv_memory_fraction, self.kv_bytes_per_block(), self.device)
        self.rope = m.build_rope(max_context + block_size, self.dtype, self.device)    # (cos, sin) per layer
        num_blocks = self.num_blocks
        slots = (num_blocks + 1) * block_size             # + the scratch block for padded graph rows
        self.scratch_block = num_blocks
        self.k_cache = torch.empty(self.n_layers, self.n_kv, slots, self.head_dim, dtype=self.dtype, device=self.device)
        self.v_cache = torch.empty_like(self.k_cache)
        for c in (self.k_cache, self.v_cache):
            c[:, :, :block_size].zero_()
            c[:, :, num_blocks * block_size:].zero_()
        self.paged = self.device.type == "cuda" and paged_attention.available()
        self.cpu_paged = self.kernels is not None and cpu_decode_attention == "auto" and not any(self.masked)
        if self.device.type == "cpu":
            log.info("CPU step: %s, decode attention %s, %s GEMMs", "fused kernels" if self.kernels else "torch ops",
                     "in place over the pool (kernel)" if self.cpu_paged
                     else f"{cpu_decode_attention} over gathered blocks",
                     f"{self.matmul or 'fp32'} ({'kernel' if self.gemm else 'oneDNN/torch'})")
        self.decode_attention = None if self.paged or self.cpu_paged else cpu_attention.choose(
            cpu_decode_attention, self.dtype, self.n_heads, self.n_kv, self.head_dim, self.device)
        self.zeroed_blocks: set[int] = {0}                # CPU path: blocks whose unwritten slots are zero
        self.pool_blocks = num_blocks + 1                 # blocks per (layer, kv head) in the pool, scratch included
        self.gather_k = torch.empty(0, device=self.device, dtype=self.dtype)   # CPU path: reused gather targets
        self.gather_v = torch.empty_like(self.gather_k)
        self.staging = Staging(self.device)
        self.graphs = None                                # cuda_graphs.DecodeGraphs, set by capture_graphs
        self.graph_error = ""

    def _load(self, w: dict[str, torch.Tensor], weight_dtype: torch.dtype) -> None:
        # Linear weights stay in weight_dtype until _prepare_linear packs them or casts them to the compute
        # dtype (an fp32 copy first would double the peak memory for nothing: bf16 -> fp16 packing is exact).
        def get(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            if name not in w:
                raise KeyError(f"checkpoint has no tensor {name!r} (expected for {type(self.model).__name__})")
            return w[name].to(device=self.device, dtype=dtype or self.dtype)

        def linear(name: str) -> torch.Tensor:
            return get(name, weight_dtype)
        self.model.load(w, get, linear)
        self.layers = self.model.layers

    def _prepare_linear(self, w: torch.Tensor) -> torch.Tensor | PackedLinear:
        """On the CPU, the weight packed once for the GEMM kind (device.PackedLinear), else in the compute dtype."""
        return PackedLinear.pack(w, self.matmul, gemm=self.gemm) or w.to(self.dtype)

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv * self.block_size * self.head_dim * elem

    def capture_graphs(self, max_batch: int) -> None:
        """CUDA only: capture decode steps for batch-size buckets up to max_batch (cuda_graphs.py)."""
        from python_backends.engine.cuda_graphs import DecodeGraphs
        try:
            self.graphs = DecodeGraphs(self, max_batch)
        except Exception as exc:          # e.g. out of memory while capturing: serve eagerly, say why
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            self.graphs, self.graph_error = None, repr(exc)

    # ------------------------------------------------------------------ batch preparation
    def prepare(self, chunks: list[SeqChunk]) -> ForwardBatch:
        """Flatten a step's chunks (decode chunks - one token, start > 0 - first) and move the metadata."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lora_rows: list[int] = []
        logits_rows: list[int] = []
        tok_seq: list[int] = []
        n_decode = 0
        for r, c in enumerate(chunks):
            n = len(c.token_ids)
            t0 = len(ids)
            if n == 1:                                   # decode rows: the common case, kept cheap
                p = c.start
                ids.append(c.token_ids[0])
                pos.append(p)
                slots.append(c.block_table[p // bs] * bs + p % bs)
                lora_rows.append(c.lora_slot)
                tok_seq.append(r)
                if c.need_logits:
                    logits_rows.append(t0)
                if p > 0 and n_decode == t0:
                    n_decode += 1
                continue
            ids.extend(c.token_ids)
            positions = range(c.start, c.start + n)
            pos.extend(positions)
            table = c.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            lora_rows.extend([c.lora_slot] * n)
            tok_seq.extend([r] * n)
            if c.need_logits:
                logits_rows.append(t0 + n - 1)
        T, S = len(ids), len(chunks)
        use_lora = any(x >= 0 for x in lora_rows)
        # Every segment starts 16-byte aligned (even int64 count): kernels then see one pointer alignment and
        # Triton compiles them once, not once per alignment pattern of a step.
        pad_t, pad_l = [0] * (T % 2), [0] * (len(logits_rows) % 2)
        packed = ids + pad_t + pos + pad_t + slots + pad_t + logits_rows + pad_l
        if use_lora:
            packed += lora_rows + pad_t
        width = 0
        if self.paged:
            width = max(-(-(c.start + len(c.token_ids)) // bs) for c in chunks)
            packed += tok_seq + pad_t
            for c in chunks:
                row = c.block_table[:width]
                packed += row
                if len(row) < width:
                    packed += [0] * (width - len(row))
        dev = self.staging.to_device(packed)
        L = len(logits_rows)
        o = 0

        def take(n: int) -> torch.Tensor:
            nonlocal o
            o += n + n % 2
            return dev[o - n - n % 2:o - n % 2]
        batch = ForwardBatch(input_ids=take(T), positions=take(T), slot_mapping=take(T), logits_rows=take(L),
                             n_decode=n_decode, lora_rows=take(T) if use_lora else None)
        if self.paged:
            batch.tok_seq = take(T)
            batch.block_tables = take(S * width).view(S, width)
        else:
            self._prepare_cpu_attention(batch, chunks, n_decode)
        return batch

    def _prepare_cpu_attention(self, batch: ForwardBatch, chunks: list[SeqChunk], n_decode: int) -> None:
        bs = self.block_size
        # The CPU path reads whole blocks, masking the unwritten tail of each sequence's last block; masked
        # weights are 0, but 0 * NaN is NaN, and a pool from torch.empty (pages stay unresident until used)
        # may hold any bits. A block is zeroed once, the first time it is a chunk's last block: every slot
        # that is ever read masked then holds a finite value (zero or an earlier owner's K/V).
        for c in chunks:
            last = c.block_table[(c.start + len(c.token_ids) - 1) // bs]
            if last not in self.zeroed_blocks:
                self.k_cache[:, :, last * bs:(last + 1) * bs].zero_()
                self.v_cache[:, :, last * bs:(last + 1) * bs].zero_()
                self.zeroed_blocks.add(last)
        if n_decode and self.cpu_paged:
            # the kernel reads each row's own blocks up to its own length: no gather, no padding, no groups
            tables = [c.block_table for c in chunks[:n_decode]]
            width = max(len(t) for t in tables)
            batch.decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            batch.decode_lens = torch.tensor([c.start + 1 for c in chunks[:n_decode]], dtype=torch.long)
        elif n_decode:
            lens = [c.start + 1 for c in chunks[:n_decode]]
            blocks = [-(-ln // bs) for ln in lens]
            groups = cpu_attention.group_by_length(blocks)
            for rows in groups:
                nbmax = max(blocks[r] for r in rows)
                # Gather whole blocks (contiguous block_size*d rows), not single slots: fewer, larger copies.
                table = torch.tensor([chunks[r].block_table[:blocks[r]] + [0] * (nbmax - blocks[r]) for r in rows],
                                     dtype=torch.long)
                ln = torch.tensor([lens[r] for r in rows])
                mask = (torch.arange(nbmax * bs).unsqueeze(0) < ln.unsqueeze(1)).view(len(rows), 1, 1, -1)
                batch.decode_groups.append(DecodeGroup(torch.tensor(rows) if len(groups) > 1 else None,
                                                       self._flat_blocks(table), mask))
            if len(groups) > 1:
                batch.decode_order = torch.argsort(torch.tensor([r for rows in groups for r in rows]))
        if len(chunks) > n_decode:
            # One SDPA call for all prefill chunks: keys = each chunk's blocks in turn; a query token sees the
            # keys of its own chunk's region up to its own position (block-diagonal, causal with offsets).
            blocks: list[int] = []
            key_owner: list[int] = []
            key_pos: list[int] = []
            q_owner: list[int] = []
            q_pos: list[int] = []
            for r, c in enumerate(chunks[n_decode:]):
                ctx = c.start + len(c.token_ids)
                nb = -(-ctx // bs)
                blocks += c.block_table[:nb]
                key_owner += [r] * (nb * bs)
                key_pos += range(nb * bs)
                q_owner += [r] * len(c.token_ids)
                q_pos += range(c.start, ctx)
            qo, qp = torch.tensor(q_owner), torch.tensor(q_pos)
            ko, kp = torch.tensor(key_owner), torch.tensor(key_pos)
            batch.prefill_blocks = self._flat_blocks(torch.tensor(blocks, dtype=torch.long))
            batch.prefill_mask = (qo.unsqueeze(1) == ko.unsqueeze(0)) & (kp.unsqueeze(0) <= qp.unsqueeze(1))
            batch.prefill_q_pos, batch.prefill_key_pos = qp, kp            # sliding windows cut the mask

    def _flat_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block ids -> rows of the pool seen as [kv_heads * pool_blocks, block_size*head_dim], head-major:
        every KV head's copy of the blocks, in order (what `_gather` reads in one index_select)."""
        heads = torch.arange(self.n_kv, dtype=torch.long).unsqueeze(1) * self.pool_blocks
        return (heads + blocks.reshape(1, -1)).reshape(-1)

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """Copy whole blocks of one layer's K or V (rows from `_flat_blocks`) into a reused buffer. One 2-D
        index_select of contiguous block rows into memory that stays resident: measured 1.9 ms for 3 x 2,080
        blocks of 4 KB, against 7.3 ms for the 3-D index_select into a fresh tensor (page faults, and a kernel
        that copies less well); in a 32-stream step with contexts of 100-1,000 tokens the gather was 3/4 of
        the step. The result is a view of the buffer, valid until the next gather into it."""
        width = self.block_size * self.head_dim
        if buffer.numel() < rows.numel() * width:
            buffer.resize_(rows.numel() * width)      # grows to the largest step seen, then stays
        out = buffer[:rows.numel() * width].view(rows.numel(), width)
        return torch.index_select(cache.view(-1, width), 0, rows, out=out)

    # ------------------------------------------------------------------ forward
    def mm(self, x: torch.Tensor, w: torch.Tensor | PackedLinear) -> torch.Tensor:
        return w(x) if isinstance(w, PackedLinear) else F.linear(x, w)

    def lin(self, x: torch.Tensor, w: torch.Tensor | PackedLinear, layer: int, name: str,
            batch: ForwardBatch) -> torch.Tensor:
        """A projection of the layer (`name` one of the model's LINEARS), with the batch's LoRA rows added."""
        y = self.mm(x, w)
        if batch.lora_rows is not None and self.lora is not None:
            y = self.lora.apply(y, x, layer, name, batch.lora_rows)
        return y

    def attention(self, li: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D] of the step's tokens (K/V already in the pool) -> [T, H * D], scaled by D**-0.5.
        Layers with a binding sliding window or a logit soft-cap (CPU only) take cpu_attention.masked_attention
        over the same gathered blocks, the window cut into the masks as transformers does (k > q - window)."""
        T = q.shape[0]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        kc, vc = self.k_cache[li], self.v_cache[li]
        if self.paged:
            return paged_attention.paged_attention(q, kc, vc, batch.block_tables, batch.tok_seq, batch.positions,
                                                   self.block_size).view(T, H * D)
        masked, window, cap = self.masked[li], self.windows[li], self.attn_softcap
        outs = []
        nd = batch.n_decode
        if nd and self.cpu_paged:                    # never for a model with masked layers
            outs.append(self.kernels.decode_attention(q[:nd].reshape(nd, H * D), kc, vc, batch.decode_tables,
                                                      batch.decode_lens, self.block_size, D ** -0.5))
        elif nd:
            parts = []
            for group in batch.decode_groups:
                qg = q[:nd] if group.rows is None else q[:nd].index_select(0, group.rows)
                rows = qg.shape[0]
                kd = self._gather(kc, group.gather, self.gather_k).view(KV, rows, -1, D)   # [KV, rows, L, D]
                vd = self._gather(vc, group.gather, self.gather_v).view(KV, rows, -1, D)
                if masked:
                    mask = group.mask                   # [rows, 1, 1, L]; keys at positions 0..length-1
                    if window is not None:
                        mask = mask & (torch.arange(mask.shape[-1]) >= mask.sum(-1, keepdim=True) - window)
                    parts.append(cpu_attention.masked_attention(qg.unsqueeze(2), kd.transpose(0, 1),
                                                                vd.transpose(0, 1), mask, cap).reshape(rows, H * D))
                else:   # GQA without repeating K/V; SDPA or batched matmuls, whichever this machine runs faster
                    parts.append(self.decode_attention(qg, kd, vd, group.mask))
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts).index_select(0, batch.decode_order))
        if T > nd:
            qp = q[nd:].transpose(0, 1).unsqueeze(0)                    # [1, H, n, D]
            kp = self._gather(kc, batch.prefill_blocks, self.gather_k).view(1, KV, -1, D)
            vp = self._gather(vc, batch.prefill_blocks, self.gather_v).view(1, KV, -1, D)
            if masked:
                mask = batch.prefill_mask
                if window is not None:
                    mask = mask & (batch.prefill_key_pos.unsqueeze(0) > batch.prefill_q_pos.unsqueeze(1) - window)
                op = cpu_attention.masked_attention(qp, kp, vp, mask, cap)
            else:
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.prefill_mask, enable_gqa=True)
            outs.append(op[0].transpose(0, 1).reshape(T - nd, H * D))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns the logits for batch.logits_rows, in order, in the compute dtype (a CUDA graph when
        one fits). Not cast to fp32 here: greedy rows take the argmax as they are (the cast is exact, so the same
        ids) and sampling casts only its rows. In-process, steps alternating with and without the cast (32 rows,
        AMD EPYC): the cast cost 0.3-3.8 % of a step."""
        if self.graphs is not None and batch.decode_only and batch.lora_rows is None:
            out = self.graphs.run(batch)
            if out is not None:
                return out
        return self.forward_eager(batch)

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """The family's forward; its layers run through the fused CPU kernels (KernelOps) where they are on."""
        return self.model.forward(self, batch, self.ops)

