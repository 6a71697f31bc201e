"""Where the engine runs and what that machine can do: device choice, CPU bf16 detection, KV pool sizing,
and the pinned staging buffer that carries each step's metadata to the device in one non-blocking copy.

Everything here is a plain function of the machine (no engine state), so the model runner, the engine and the
benchmarks make the same decisions.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`cpu`, `cuda`, `cuda:N` or `auto` (cuda when one is visible); asking for cuda without one is an error."""
    name = (name or "cpu").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"engine device {name!r}: allowed are cpu, cuda, cuda:N, auto")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"engine device {name!r} requested but torch sees no CUDA device")
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), so oneDNN's bf16 GEMM beats fp32.

    torch reports the vector ISA it dispatches to (`get_cpu_capability`); the bf16 dot-product units are flags
    of their own, read from /proc/cpuinfo (Linux; elsewhere we assume none, the safe choice)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:
        capability = ""
    if "AVX512" not in capability.upper():
        return False
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fp32_matmul_rows(setting: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows from which bf16 mode uses fp32 weight copies; 0 = never. -1 (auto): never on CUDA or on CPUs with
    bf16 units; 16 on CPUs without them (their bf16 GEMM runs at about half the fp32 rate for many rows)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or setting == 0:
        return 0
    if setting > 0:
        return setting
    return 0 if cpu_has_bf16_units() else 16


class PackedLinear:
    """A CPU linear weight pre-packed once into oneDNN's blocked layout (what inductor's freezing pass does):
    the same products, bit for bit (tested), without re-laying the weight out on every call - 10-40 % faster
    GEMMs for 1-32 rows on the CPUs we run. `pack` returns None where this torch build has no oneDNN linear;
    callers then keep the plain weight and F.linear."""

    def __init__(self, packed: torch.Tensor):
        self.packed = packed

    @staticmethod
    def pack(weight: torch.Tensor, rows_hint: int = 32) -> "PackedLinear | None":
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
            probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except (AttributeError, RuntimeError) as exc:       # op missing or unsupported on this CPU
            log.info("oneDNN weight packing unavailable (%s); plain F.linear", exc)
            return None
        return PackedLinear(packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class CpuThreads:
    """torch's intra-op threads, chosen per step on the CPU: `small` threads for steps of at most `small_rows`
    rows (few decoding streams), `full` otherwise. A few-row step is ~1,800 tiny ops, each ending in an OpenMP
    barrier; inside tritonserver, whose own threads (gRPC, the response courier, the client on a small box)
    share the cores, a barrier waits whenever one worker is descheduled. Measured on a 2-core Xeon, one stream
    through Triton: 2 threads 74.7 ms per token, 1 thread 50.4 ms (in-process, with no other threads, 2 threads
    win: 37.8 vs 50.5 ms); 32 streams: 2 threads still win (146 vs 127 tok/s). Switching costs one call only
    when the choice changes."""

    def __init__(self, full: int, small: int, small_rows: int):
        self.full, self.small, self.small_rows = full, (small or full), small_rows
        self.current = 0
        self.use(full)

    def use(self, n: int) -> None:
        if n != self.current:
            torch.set_num_threads(n)
            self.current = n

    def for_rows(self, rows: int) -> None:
        self.use(self.small if rows <= self.small_rows else self.full)


def free_memory_bytes(device: torch.device) -> int:
    """Memory the KV pool may take from: free device memory on CUDA, available RAM on the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def kv_blocks_for_memory(fraction: float, bytes_per_block: int, device: torch.device, cap: int = 1 << 20) -> int:
    """How many KV blocks `fraction` of the free memory holds (at least 2: block 0 is reserved)."""
    if not 0.0 < fraction <= 0.98:
        raise ValueError(f"kv_memory_fraction {fraction}: allowed is 0 < fraction <= 0.98")
    blocks = int(free_memory_bytes(device) * fraction) // bytes_per_block
    log.info("KV pool: %.2f of free %s memory -> %d blocks", fraction, device.type, blocks)
    return max(2, min(blocks, cap))


class Staging:
    """Host->device transfer of one int64 vector per step: pinned host buffers (two, used in turn, so a step
    can be packed while the previous copy may still be in flight) and one device buffer per slot; on the CPU
    the packed tensor is used as is."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = device
        self.turn = 0
        self.host: list[torch.Tensor] = []
        self.dev: list[torch.Tensor] = []
        if device.type == "cuda":
            self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(capacity, dtype=torch.int64, device=self.device) for _ in range(2)]

    def to_device(self, values: list[int]) -> torch.Tensor:
        packed = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cpu":
            return packed
        n = packed.numel()
        if n > self.host[0].numel():
            torch.cuda.current_stream(self.device).synchronize()
            self._grow(max(n, 2 * self.host[0].numel()))
        self.turn ^= 1
        host, dev = self.host[self.turn][:n], self.dev[self.turn][:n]
        host.copy_(packed)
        dev.copy_(host, non_blocking=True)
        return dev
