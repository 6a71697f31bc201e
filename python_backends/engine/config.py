"""Engine configuration: one dataclass, filled from Triton's config.pbtxt parameters, then env overrides.

Every field may be overridden by `FLEET_ENGINE_<FIELD NAME IN UPPER CASE>` so tests and benchmarks can
resize the KV pool or the step budget without rendering another model repository. The overrides are read
once, at start, by `engine_overrides()` (a pydantic-settings model made from the dataclass's own fields,
so a field is declared once) and passed to `EngineConfig.from_params`.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
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
    small_step_threads: int = 0         # CPU: threads for steps of <= small_step_max_rows rows (0 = `threads`;
    small_step_max_rows: int = 4        # replicas on shared cores get 1), see device.CpuThreads
    cpu_matmul: str = "auto"            # bf16 on CPU: auto | bf16 | fp16 | fp32 | int8, see device.cpu_matmul_kind
    cpu_decode_attention: str = "auto"  # CPU: auto (the kernels' paged attention, else timed at start) | sdpa
                                        # | matmul, see cpu_attention
    cpu_kernels: str = "auto"           # CPU: fused kernels, auto (where they build) | on | off, see cpu_kernels
    cpu_bf16_gemm: str = "auto"         # CPU bf16 GEMMs: auto (timed at start) | kernel | onednn, see device
    cuda_graphs: int = 1                # CUDA: replay decode steps from graphs captured per batch bucket
    async_decode: int = 0               # 1: launch decode step N+1 before step N's ids reach the host (host
                                        # work overlaps the device); off by default: see docs/engine.md
    stream_interval: int = 4            # tokens per streamed response while a step has >= min_rows rows
    stream_interval_min_rows: int = 8   # (interactive tier and first tokens excepted), see stream_coalescer
    stream_interval_max: int = 16       # the interval grows with the step's rows up to this (0: fixed)
    default_max_tokens: int = 64
    warmup_seqs: int = 16               # sequences of the warm-up burst run before the model reports ready (0 = off),
                                        # see warmup.py
    state_report_interval_s: float = 0.2
    state_full_snapshot_s: float = 10.0
    test_step_sleep_s: float = 0.0      # tests only (FLEET_ENGINE_TEST_STEP_SLEEP_S): sleep this long after every
                                        # step, a slow replica that keeps reporting (tests/reliability/test_self_healing.py)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_params(cls, params: dict[str, str], overrides: Mapping[str, Any] | None = None) -> "EngineConfig":
        """Build from string parameters (Triton's), then apply `overrides` (typed values, e.g. from
        `engine_overrides()`); unrendered `${...}` placeholders and empty strings count as unset."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            raw = params.get(f.name)
            if raw is not None and raw != "" and not (isinstance(raw, str) and raw.startswith("${")):
                values[f.name] = _coerce(f.type, raw)
        values.update({k: v for k, v in (overrides or {}).items() if v is not None and v != ""})
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


def engine_overrides() -> dict[str, Any]:
    """The FLEET_ENGINE_* variables that are set, typed from EngineConfig's fields (a bad value raises a
    pydantic ValidationError naming the field). Called once, at start, by the Triton shim."""
    # Imported here: the engine itself must import on GPU images that carry torch but not the service stack.
    from pydantic import create_model
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class _EngineEnv(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="FLEET_ENGINE_", extra="ignore", frozen=True,
                                          env_ignore_empty=True)
    hints = typing.get_type_hints(EngineConfig)
    fields: dict[str, Any] = {f.name: (hints[f.name] | None, None)
                              for f in dataclasses.fields(EngineConfig) if f.name != "extra"}
    env_model = create_model("EngineEnv", __base__=_EngineEnv, **fields)
    return env_model().model_dump(exclude_none=True)
