"""Where the engine runs and what that machine can do: device choice, CPU bf16 detection and the CPU GEMM kind
it implies, pre-packed CPU weights, KV pool sizing, and the pinned staging buffer that carries each step's
metadata to the device in one non-blocking copy.

Everything here is a plain function of the machine (no engine state), so the model runner, the engine and the
benchmarks make the same decisions.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable
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
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's /proc/cpuinfo text, where its feature flags are (Linux; "" elsewhere: no flags known)."""
    try:
        return Path(cpuinfo).read_text()
    except OSError:
        return ""


CPU_MATMULS = ("auto", "bf16", "fp16", "fp32", "int8")
INT8_MAX_ROWS = 4   # kind int8: GEMMs of at most this many rows read the int8 weights (PackedLinear)


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def cpu_matmul_kind(setting: str, dtype: torch.dtype, device: torch.device) -> str:
    """How a bf16 model multiplies its weights on the CPU; "" where the question does not arise (CUDA, or a
    model run in fp32/fp16, whose weights are used as they are).
    - bf16: bf16 weights and activations (oneDNN-packed where this CPU supports it);
    - fp16: the bf16 weights stored as fp16 (exact: fp16 holds every bf16 value of a weight's range) in
      fbgemm's packed layout, multiplied in fp32; activations and the KV pool are fp32;
    - fp32: fp32 weight copies, fp32 activations;
    - int8 (opt-in, never auto: it changes outputs): GEMMs of at most INT8_MAX_ROWS rows (one to four decoding
      streams, where a step is bound by reading the weights) use weights stored in int8 per output channel with
      bf16 activations (torch's weight-only int8 kernel), larger ones the bf16 weights: half the bytes where it
      matters, both copies in memory (+50 %). Needs bf16 units, as its larger steps run in bf16.
    auto: bf16 on CPUs with bf16 units (AVX512-BF16/AMX), else fp16 where torch has fbgemm, else fp32. On a
    2-core AVX2 EPYC (no bf16 units), the 30 layers' GEMMs + lm_head of SmolLM2-135M per step, 2 threads:
    1 row bf16 28 ms, fp32 34 ms, fp16 14 ms; 32 rows bf16 621 ms, fp32 149 ms, fp16 85 ms (docs/engine.md)."""
    if setting not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul {setting!r}: allowed are {', '.join(CPU_MATMULS)}")
    if device.type != "cpu" or dtype != torch.bfloat16:
        return ""
    if setting != "auto":
        if setting == "fp16" and not fbgemm_available():
            raise ValueError("cpu_matmul 'fp16' needs torch's fbgemm engine, which this build lacks")
        if setting == "int8" and not cpu_has_bf16_units():
            raise ValueError("cpu_matmul 'int8' needs a CPU with bf16 units (AVX512-BF16 or AMX): its steps of more "
                             f"than {INT8_MAX_ROWS} rows run in bf16; this CPU has none (use fp16)")
        return setting
    if cpu_has_bf16_units():
        return "bf16"
    return "fp16" if fbgemm_available() else "fp32"


class PackedLinear:
    """A CPU linear weight packed once for its GEMM library, so no call re-lays it out:
    - kind "bf16": oneDNN's blocked layout (what inductor's freezing pass does); bit for bit F.linear's products
      (tested), 10-40 % faster for 1-32 rows on CPUs with AVX512; or, given `gemm` (the fused kernels' module),
      that module's layout for its bf16 linear (csrc/cpu_gemm.cpp; see choose_bf16_gemm);
    - kind "fp16": fbgemm's fp16 packed matrix; fp32 activations in and out, fp32 accumulation;
    - kind "int8": the bf16 packing plus an int8 copy (symmetric per output row, scale = the row's largest
      magnitude / 127) that inputs of at most INT8_MAX_ROWS rows are multiplied with.
    `pack` returns None for any other kind (fp32, "" on CUDA) and where this torch build or CPU lacks the
    kernel; callers then keep a plain weight."""

    def __init__(self, packed: object, kind: str, gemm: object = None, out_features: int = 0):
        self.packed, self.kind, self.gemm, self.out_features = packed, kind, gemm, out_features

    @staticmethod
    def pack(weight: torch.Tensor, kind: str = "bf16", rows_hint: int = 32,
             gemm: object = None) -> "PackedLinear | None":
        if weight.device.type != "cpu":
            return None
        try:
            if kind == "fp16":
                linear = PackedLinear(torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None),
                                      kind)
            elif kind == "int8":
                bf16 = PackedLinear.pack(weight, "bf16", rows_hint, gemm)
                if bf16 is None:
                    return None
                linear = PackedLinear((*int8_per_row(weight), bf16), kind)
            elif kind == "bf16" and weight.dtype == torch.bfloat16 and gemm is not None:
                linear = PackedLinear(gemm.pack_linear_weight(weight), kind, gemm, weight.shape[0])
            elif kind == "bf16" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
                linear = PackedLinear(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint), kind)
            else:
                return None
            linear(torch.ones(1, weight.shape[1], dtype=torch.float32 if kind == "fp16" else weight.dtype))
        except (AttributeError, RuntimeError) as exc:       # op missing or unsupported on this CPU
            log.info("%s weight packing unavailable (%s); plain F.linear", kind, exc)
            return None
        return linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)
        if self.kind == "int8":
            q, scales, bf16 = self.packed
            if x.shape[0] > INT8_MAX_ROWS:     # int8 kernel at 32 rows: 55 ms per 30 layers, bf16 15 ms
                return bf16(x)
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scales)
        if self.gemm is not None:
            return self.gemm.linear_packed(x, self.packed, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")


BF16_GEMMS = ("auto", "kernel", "onednn")


def choose_bf16_gemm(setting: str, kernels: object, sample: torch.Tensor | None, rows: int) -> str:
    """Which library multiplies bf16 weights on this CPU: "kernel" (the fused kernels' bf16 linear, fp32 FMAs on
    weights widened in registers) or "onednn" (PackedLinear's oneDNN packing). `auto` times both once on `sample`
    (one of the model's weights) for 1 row and for `rows` rows and keeps the one faster in sum: which wins depends
    on the CPU. On a 2-vCPU Xeon with AVX512-BF16 and no AMX, 30 layers + lm_head of SmolLM2-135M, 2 threads:
    1 row 13.0 vs 21.5 ms, 32 rows 48.3 vs 73.9 ms (the kernel). Where the CPU has AMX the kernel runs 7 rows
    and more on tiles too (2-vCPU AMX Xeon: 1 row 8.2 vs 13.0 ms, 32 rows 10-11 vs 15-28 ms) and is kept.
    Without the kernels (or an error timing them) the answer is onednn; with no
    sample (a model whose GEMMs are not bf16) the setting is only checked."""
    if setting not in BF16_GEMMS:
        raise ValueError(f"cpu_bf16_gemm {setting!r}: allowed are {', '.join(BF16_GEMMS)}")
    if sample is None:
        return "onednn"
    if setting == "kernel" and kernels is None:
        raise ValueError("cpu_bf16_gemm 'kernel' needs the fused CPU kernels (cpu_kernels), which are off or unbuilt")
    if kernels is None:
        return "onednn"
    if setting != "auto":
        return setting
    try:
        linears = {name: PackedLinear.pack(sample, "bf16", rows, gemm) for name, gemm in (("kernel", kernels),
                                                                                           ("onednn", None))}
        if None in linears.values():              # one of them cannot pack here: the other it is
            return "onednn" if linears["kernel"] is None else "kernel"
        timed = {name: 0.0 for name in linears}
        for n in (1, max(1, rows)):
            x = torch.randn(n, sample.shape[1], dtype=sample.dtype)
            for name, seconds in fastest({name: (lambda f=f: f(x)) for name, f in linears.items()}).items():
                timed[name] += seconds
    except RuntimeError as exc:
        log.warning("bf16 linear kernel failed its start-up timing (%s); oneDNN multiplies", exc)
        return "onednn"
    choice = min(timed, key=timed.get)
    tiles = ", AMX tiles from 7 rows" if choice == "kernel" and kernels.amx_tiles() else ""
    log.info("bf16 GEMM: %s%s (1 + %d rows on a %s weight: kernel %.3f ms, oneDNN %.3f ms)", choice, tiles, rows,
             "x".join(map(str, sample.shape)), timed["kernel"] * 1e3, timed["onednn"] * 1e3)
    return choice


def fastest(calls: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
    """Each call's best time (s) of `repeats` after one warm-up call (kernel selection, first-touch), the calls
    interleaved so that a burst of load on a shared machine hits all alike."""
    for call in calls.values():
        call()
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, bf16 scale per output row): symmetric, scale ~ the row's largest magnitude / 127, rounded
    to bf16 (the kernel's scale dtype) before quantizing, so that the scale the kernel applies is the one used."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scales


class CpuThreads:
    """torch's intra-op threads, chosen per step on the CPU: `small` threads for steps of at most `small_rows`
    rows (few decoding streams), `full` otherwise. A few-row step is ~1,800 tiny ops, each ending in an OpenMP
    barrier. On cores the replica owns (one OpenMP pool whose workers spin, see engine.loop) 2 threads win:
    one stream in-process, 2-core Ice Lake-class Xeon, 33.6 vs 49.3 ms per token (Zen 4 EPYC 15.1 vs 17.5).
    Where busy threads of other processes share the cores and workers sleep soon, 1 thread wins (through
    Triton, 2-core Xeon: 74.7 -> 50.4 ms), so replicas started on shared cores get small_step_threads=1
    (common.vendor.triton_env). Switching costs one call only when the choice changes."""

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
