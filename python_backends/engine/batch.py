"""What one step hands the model runner: each sequence's chunk (SeqChunk) and the flattened, device-resident
metadata of the whole step (ForwardBatch). Shared by the model runner and the CUDA-graph runner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions start..start+len-1."""
    token_ids: list[int]
    start: int
    block_table: list[int]
    need_logits: bool
    lora_slot: int = -1          # -1 = base model


@dataclass
class DecodeGroup:
    """CPU: decode rows of similar context length, attended together (cpu_attention.group_by_length)."""
    rows: torch.Tensor | None      # their indices among the decode rows; None = all of them, in order
    gather: torch.Tensor           # pool rows of [rows, blocks] block ids per KV head (ModelRunner._flat_blocks)
    mask: torch.Tensor             # [rows, 1, 1, blocks*bs]: True where a key is in the row's context


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_rows: torch.Tensor
    n_decode: int                              # leading one-token rows (decodes)
    lora_rows: torch.Tensor | None = None
    tok_seq: torch.Tensor | None = None        # CUDA: block-table row of each token
    block_tables: torch.Tensor | None = None   # CUDA: [chunks, max blocks]
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # CPU: decode rows by context length
    decode_order: torch.Tensor | None = None   # CPU, several groups: row i of the output is row order[i] of the
                                               # groups' outputs concatenated
    decode_tables: torch.Tensor | None = None   # CPU kernels: [decode rows, max blocks] block tables
    decode_lens: torch.Tensor | None = None     # CPU kernels: [decode rows] keys per row
    prefill_blocks: torch.Tensor | None = None  # CPU: pool rows of all prefill chunks' blocks per KV head
    prefill_mask: torch.Tensor | None = None    # CPU: [prefill tokens, keys]
    prefill_q_pos: torch.Tensor | None = None   # CPU: position of each prefill token (sliding windows)
    prefill_key_pos: torch.Tensor | None = None  # CPU: position of each gathered key in its chunk's sequence

    @property
    def decode_only(self) -> bool:
        return self.n_decode == self.input_ids.shape[0]
