"""CUDA graphs for decode steps, captured once per batch-size bucket (the vLLM way).

A decode step of B sequences launches a few hundred small kernels; replaying them from a graph removes the
per-kernel launch cost that otherwise bounds the step. Each bucket's graph reads fixed device buffers (ids,
positions, slots, block tables) and writes a fixed logits buffer; a step of n <= bucket sequences copies its
metadata into the first n rows (device-to-device), points the padding rows' K/V writes at the scratch block
(so they never touch a live sequence's slots) and replays. Buckets are captured largest first and share one
memory pool. Prefill and LoRA steps run eagerly.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from python_backends.engine.batch import ForwardBatch

log = logging.getLogger(__name__)


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, runner: Any, max_batch: int):
        """runner: the ModelRunner whose forward_eager is captured."""
        self.runner = runner
        dev = runner.device
        self.max_batch = max_batch
        self.buckets = buckets_for(max_batch)
        width = runner.max_blocks_per_seq
        self.scratch_slot = runner.scratch_block * runner.block_size
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=dev)
        self.tables = torch.full((max_batch, width), runner.scratch_block, dtype=torch.int64, device=dev)
        self.replays = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            batch = ForwardBatch(input_ids=self.ids[:b], positions=self.pos[:b], slot_mapping=self.slots[:b],
                                 logits_rows=self.rows[:b], n_decode=b, tok_seq=self.rows[:b],
                                 block_tables=self.tables[:b])
            with torch.inference_mode():
                for _ in range(2):                        # warm-up: Triton JIT, cuBLAS handles, allocator
                    runner.forward_eager(batch)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = runner.forward_eager(batch)
            self.graphs[b] = graph
        torch.cuda.synchronize(dev)
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs), max_batch,
                 time.monotonic() - t0)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Replay the smallest bucket that holds this decode step; None if none does (caller runs eagerly)."""
        n = batch.n_decode
        b = self.bucket(n)
        width = batch.block_tables.shape[1] if batch.block_tables is not None else 0
        if b is None or width > self.tables.shape[1]:
            return None
        self.ids[:n].copy_(batch.input_ids)
        self.pos[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.slots[n:b].fill_(self.scratch_slot)
        self.tables[:n, :width].copy_(batch.block_tables)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:n]
