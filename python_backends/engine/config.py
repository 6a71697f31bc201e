"""Engine configuration: one dataclass, filled from Triton's config.pbtxt parameters, then env overrides.

Every field may be overridden by `FLEET_ENGINE_<FIELD NAME IN UPPER CASE>` so tests and benchmarks can
resize the KV pool or the step budget without rendering another model repository.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EngineConfig:
    weights_dir: str
    adapters_dir: str = ""
    dtype: str = "bf16"                 # bf16 (fast on these CPUs) or fp32 (exactness tests)
    device: str = "cpu"                 # cpu | cuda | cuda:N | auto
    max_context: int = 2048             # prompt + output tokens per sequence
    block_size: int = 16                # tokens per KV block; must match the router's hashing
    num_kv_blocks: int = 4096           # blocks in the one KV pool (block 0 is reserved); 0 = from free memory
    kv_memory_fraction: float = 0.85    # share of free device memory (RAM on CPU) the pool takes when sized
    max_num_batched_tokens: int = 256   # per-step token budget: decodes + prefill chunks
    max_num_seqs: int = 64              # running sequences at most
    output_estimate: int = 64           # tokens of output reserved per admitted sequence (capped by max_tokens)
    max_loras: int = 8                  # adapters resident at once (LRU beyond)
    max_lora_rank: int = 16
    threads: int = 2                    # torch intra-op threads
    fp32_matmul_min_tokens: int = -1    # bf16 on CPU: steps of >= this many rows use fp32 weight copies;
                                        # 0 = never, -1 = auto (16 unless the CPU has bf16 units)
    cuda_graphs: int = 1                # CUDA: replay decode steps from graphs captured per batch bucket
    default_max_tokens: int = 64
    state_report_interval_s: float = 0.2
    state_full_snapshot_s: float = 10.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: dict[str, str], env: dict[str, str] | None = None) -> "EngineConfig":
        """Build from string parameters (Triton's), then apply FLEET_ENGINE_* env overrides."""
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            raw = env.get(f"FLEET_ENGINE_{f.name.upper()}") or params.get(f.name)
            if raw is None or raw == "" or (isinstance(raw, str) and raw.startswith("${")):
                continue
            values[f.name] = _coerce(f.type, raw)
        if "weights_dir" not in values:
            raise ValueError("engine config needs weights_dir")
        return cls(**values)

    @property
    def weights_path(self) -> Path:
        return Path(self.weights_dir)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_context // self.block_size)


def _coerce(type_name: Any, raw: Any) -> Any:
    name = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    if name == "int":
        return int(raw)
    if name == "float":
        return float(raw)
    return str(raw)
