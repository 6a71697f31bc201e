"""The replica state report: one typed message, built by the engine (python_backends/engine/state_report.py,
and any other reporter beside a replica) and parsed by the router (router_service/replica_state.py).

Like vLLM's KV events, the cached prefix blocks travel as chain hashes (common/hashing.py): a full list on
start and every ~10 s (`full_snapshot`), deltas in between. Strict types and bounded sizes: a report that
does not fit is refused whole (docs/architecture.md, State reports).
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool

DEFAULT_BLOCK_SIZE = 16
MAX_HASHES = 1_000_000  # a full snapshot of a large GPU KV cache; bounds memory per report
Count = Annotated[int, Field(strict=True, ge=0, le=2**40)]
Gauge = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
Hash = Annotated[int, Field(strict=True, ge=0, lt=2**64)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]


class ReplicaReport(BaseModel):
    """The state report's schema: anything else (wrong types, unknown fields, huge lists) is refused."""
    model_config = ConfigDict(extra="forbid")

    replica_id: Name
    model: str = Field(default="", max_length=128)
    version: str = Field(default="", max_length=64)
    region: str = Field(default="local", max_length=32)
    ts: Gauge = 0.0
    # None = the reporter does not know (the GPU reporter leaves out a backend metric it has not seen move)
    kv_blocks_total: Count | None = None
    kv_blocks_free: Count | None = None
    block_size: Annotated[int, Field(strict=True, ge=1, le=4096)] = DEFAULT_BLOCK_SIZE
    running: Count | None = None
    waiting: Count = 0
    queue_wait_ms_p95: Gauge = 0.0
    ttft_ms_p95: Gauge = 0.0
    tokens_per_s: Gauge = 0.0
    # engine steps completed since start; None = not known (a reporter beside TensorRT-LLM). The router tells a
    # slow replica (the counter moves) from a hung one (docs/reliability.md, Slow is not dead)
    steps: Count | None = None
    adapters_loaded: list[Name] = Field(default_factory=list, max_length=4096)
    full_snapshot: StrictBool = False
    draining: StrictBool = False
    prefix_hashes: list[Hash] | None = Field(default=None, max_length=MAX_HASHES)
    prefix_hashes_added: list[Hash] = Field(default_factory=list, max_length=MAX_HASHES)
    prefix_hashes_removed: list[Hash] = Field(default_factory=list, max_length=MAX_HASHES)
    # False: the replica cannot report cached blocks (TensorRT-LLM under Triton); the router uses its routed history
    prefix_hashes_reported: StrictBool = True
