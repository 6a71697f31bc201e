"""Multi-LoRA: PEFT-format adapters (adapter_config.json + adapter_model.safetensors), many per replica.

Resident adapters live in `max_loras` slots of stacked buffers per layer and per fused projection
(qkv, o, gate_up, down). A fused projection's adapter is stored as A = cat(A_q, A_k, A_v) and a block-diagonal
B, so one pair of low-rank matmuls serves the fused matmul; the PEFT scale (alpha / r) is folded into B.
Ranks below `max_lora_rank` are zero-padded, which adds nothing to the output.

Per step every token row carries its adapter slot (-1 = base). Decode-sized batches use gathered batched
matmuls (one bmm pair for all rows, whatever their adapters); large prefill batches group rows by adapter
(a segmented matmul), so a mixed batch never pays for the base rows and never copies per-row B matrices.

Slots are an LRU cache: an adapter loads on first use; a slot whose adapter no running sequence uses may be
evicted for a new one. Adapters are named by their folder under adapters_dir; a name is never a path
(common.names.ADAPTER_NAME_RE), so no request can load a folder outside adapters_dir.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.names import valid_adapter_name

# fused projection -> its PEFT sub-modules, in the order of the fused output rows
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
BATCHED_ROWS_MAX = 64


class AdapterError(ValueError):
    pass


class LoraManager:
    def __init__(self, adapters_dir: str, n_layers: int, dims: dict[str, tuple[int, list[int]]], dtype: torch.dtype,
                 max_loras: int = 8, max_rank: int = 16, device: torch.device | str = "cpu"):
        """dims: fused name -> (in_features, [out_features of each sub-module])."""
        self.adapters_dir = Path(adapters_dir) if adapters_dir else None
        self.n_layers, self.dims, self.dtype = n_layers, dims, dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        for name, (fin, outs) in dims.items():
            r = max_rank * len(outs)
            self.A[name] = torch.zeros(n_layers, max_loras, r, fin, dtype=dtype, device=device)
            self.B[name] = torch.zeros(n_layers, max_loras, sum(outs), r, dtype=dtype, device=device)
        self.slots: OrderedDict[str, int] = OrderedDict()   # name -> slot, LRU order (oldest first)
        self.pins: dict[str, int] = {}                         # name -> running sequences using it
        self.loads = 0

    # ------------------------------------------------------------------ cache
    def available(self, name: str) -> bool:
        return self._path(name) is not None

    def _path(self, name: str) -> Path | None:
        if not self.adapters_dir or not valid_adapter_name(name):
            return None
        path = self.adapters_dir / name
        if path.resolve().parent != self.adapters_dir.resolve():  # e.g. a symlink planted in adapters_dir
            return None
        return path if (path / "adapter_config.json").exists() else None

    def acquire(self, name: str) -> int | None:
        """Slot of adapter `name` (loading it, evicting the LRU unpinned one); None if all slots are pinned."""
        if name in self.slots:
            self.slots.move_to_end(name)
        else:
            path = self._path(name)
            if path is None:
                raise AdapterError(f"unknown adapter {name!r}")
            if len(self.slots) < self.max_loras:
                slot = len(self.slots)
            else:
                victim = next((n for n in self.slots if self.pins.get(n, 0) == 0), None)
                if victim is None:
                    return None
                slot = self.slots.pop(victim)
            self._load(path, slot)
            self.slots[name] = slot
            self.loads += 1
        self.pins[name] = self.pins.get(name, 0) + 1
        return self.slots[name]

    def release(self, name: str) -> None:
        if self.pins.get(name, 0) > 0:
            self.pins[name] -= 1

    def loaded(self) -> list[str]:
        return list(self.slots)

    def _load(self, path: Path, slot: int) -> None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        r = int(cfg["r"])
        if r > self.max_rank:
            raise AdapterError(f"adapter {path.name} has rank {r} > max_lora_rank {self.max_rank}")
        alpha = float(cfg.get("lora_alpha", r))
        scale = alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
        weights = load_file(str(path / "adapter_model.safetensors"))
        by_module: dict[str, torch.Tensor] = {}
        for key, value in weights.items():
            m = re.search(r"layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
            if m:
                by_module[f"{m.group(1)}|{m.group(2)}|{m.group(3)}"] = value
        for name, (fin, outs) in self.dims.items():
            self.A[name][:, slot].zero_()
            self.B[name][:, slot].zero_()
            for li in range(self.n_layers):
                row = 0
                for j, (sub, fout) in enumerate(zip(FUSED[name], outs)):
                    a = by_module.get(f"{li}|{sub}|A")
                    b = by_module.get(f"{li}|{sub}|B")
                    if a is not None and b is not None:
                        c0 = j * self.max_rank
                        self.A[name][li, slot, c0:c0 + r] = a.to(self.dtype)
                        self.B[name][li, slot, row:row + fout, c0:c0 + r] = (b.float() * scale).to(self.dtype)
                    row += fout

    # ------------------------------------------------------------------ compute
    def apply(self, y: torch.Tensor, x: torch.Tensor, layer: int, name: str, rows: torch.Tensor) -> torch.Tensor:
        """y += B[slot] @ A[slot] @ x for every row whose slot >= 0."""
        if name not in self.A:
            return y
        A, B = self.A[name][layer], self.B[name][layer]
        if rows.shape[0] <= BATCHED_ROWS_MAX:
            sel = (rows >= 0).nonzero().squeeze(1)
            slots = rows[sel]
            t = torch.bmm(A[slots], x[sel].unsqueeze(2))            # [n, r, 1]
            delta = torch.bmm(B[slots], t).squeeze(2)               # [n, out]
            return y.index_add(0, sel, delta)
        for slot in rows.unique().tolist():
            if slot < 0:
                continue
            sel = (rows == slot).nonzero().squeeze(1)
            delta = (x[sel] @ A[slot].T) @ B[slot].T
            y = y.index_add(0, sel, delta)
        return y
