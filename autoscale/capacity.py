"""Per-replica capacity model: how many requests/s one replica sustains while every stream keeps its speed.

A replica is `gpus_per_replica` GPUs serving one model. Its throughput is described by a prefill rate
(tokens/s, compute-bound) and a decode step-time curve `step(B) = s0 + s1 * B` (B = sequences in the
continuous batch): s0 is the fixed part of a step (reading the weights from HBM, launch/all-reduce
overhead), s1 the per-sequence part (its KV read and compute). Without a measured curve, s0 comes from
the model shape (weight bytes per GPU / usable HBM bandwidth + a step overhead) and s1 from the
requirements' decode figure, read as aggregate tokens/s at the batch whose streams just make the speed
target: step(decode / target) = 1 / target.

Colocated replicas interleave prefill chunks with decode steps (chunked prefill), so a step carrying
prefill is longer. With arrival rate lam per replica, P uncached prompt tokens and O output tokens per
request, and every stream at the target speed v, a step must stay <= 1 / v:
    s0 + s1 * (lam * O / v) + (lam * P / prefill) / v <= 1 / v   ->   lam <= (1 - s0 v) / (s1 O + P / prefill)
and the decoding sequences (lam O / v, Little's law) must fit the KV cache. A disaggregated prefill
replica only runs prefill (lam <= prefill / P); a decode replica only decodes (P = 0 above) and also
holds each request's KV while it is transferred in. Replica-seconds per request = 1 / max rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

HBM_EFFICIENCY = 0.8  # achievable share of the HBM bandwidth for a weight read


@dataclass(frozen=True)
class ModelShape:
    """The model's architecture as far as memory goes: weights and KV bytes per token (GQA)."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: float
    weights_gb: float

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V for every layer and KV head, whatever the tensor-parallel split."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of the fleet (assumptions.json "gpu"; the requirements' 80 GB parts)."""

    memory_gb: float = 80.0
    memory_utilisation: float = 0.9  # share of GPU memory the engine may use (weights + KV)
    hbm_tb_per_s: float = 3.35
    kv_link_gb_per_s: float = 25.0  # prefill -> decode KV transfer (disaggregated pools)


@dataclass(frozen=True)
class LoraMix:
    """The adapters a pool serves and what mixing them into a batch costs (S-LoRA style kernels)."""

    adapters: int = 0
    traffic_share: float = 0.0  # share of the pool's requests that name an adapter
    slowdown: float = 1.0  # step time of a batch with adapters over one without

    @property
    def compute_factor(self) -> float:
        """Average slowdown of a batch that mixes base and LoRA requests."""
        return 1.0 + self.traffic_share * (self.slowdown - 1.0)


@dataclass(frozen=True)
class ModelProfile:
    """Throughput, shape and start-up assumptions for one model pool (see simulator/assumptions.json)."""

    name: str
    gpus_per_replica: int
    traffic_share: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # aggregate, at the batch where each stream just makes the speed target
    cold_start_s: tuple[float, float]
    shape: ModelShape
    gpu: GpuSpec = field(default_factory=GpuSpec)
    lora: LoraMix = field(default_factory=LoraMix)
    step_overhead_ms: float = 1.0  # launch / all-reduce time per decode step on top of the weight read
    decode_step_s: tuple[float, float] | None = None  # measured (s0, s1); None = derived as described above
    min_idle_replicas: int = 0
    calibration: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, raw: dict, gpu: dict | None = None) -> "ModelProfile":
        """From an assumptions.json model entry; `gpu` is the fleet's GPU entry (the model's own wins)."""
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        fields["cold_start_s"] = tuple(fields["cold_start_s"])
        fields["shape"] = ModelShape(**raw["shape"])
        fields["gpu"] = GpuSpec(**(raw.get("gpu") or gpu or {}))
        fields["lora"] = LoraMix(**(raw.get("lora") or {}))
        if fields.get("decode_step_s") is not None:
            fields["decode_step_s"] = tuple(fields["decode_step_s"])
        return cls(**fields)

    @property
    def compute_factor(self) -> float:
        return self.lora.compute_factor

    @property
    def kv_bytes_per_token(self) -> float:
        return self.shape.kv_bytes_per_token

    @property
    def kv_capacity_tokens(self) -> float:
        """Tokens of KV cache one replica holds: usable memory minus the weights."""
        gpu, weights_gb = self.gpu, self.shape.weights_gb
        free_gb = self.gpus_per_replica * gpu.memory_gb * gpu.memory_utilisation - weights_gb
        if free_gb <= 0:
            raise ValueError(f"{self.name}: {weights_gb} GB of weights do not fit {self.gpus_per_replica} x "
                             f"{gpu.memory_gb} GB at {gpu.memory_utilisation:.0%} memory use")
        return free_gb * 1e9 / self.kv_bytes_per_token

    def step_curve(self, target_tokens_per_s: float) -> tuple[float, float]:
        """(s0, s1) of step(B) = s0 + s1 B in seconds, LoRA factor included."""
        if self.decode_step_s is not None:
            s0, s1 = self.decode_step_s
        else:
            s0 = (self.shape.weights_gb / self.gpus_per_replica) / (self.gpu.hbm_tb_per_s * 1e3 * HBM_EFFICIENCY) \
                + self.step_overhead_ms / 1e3
            b_star = self.decode_tokens_per_s / target_tokens_per_s
            s1 = (1.0 / target_tokens_per_s - s0) / b_star
            if s1 <= 0:
                raise ValueError(f"{self.name}: a {s0 * 1e3:.1f} ms fixed step cannot give {target_tokens_per_s} "
                                 "tokens/s per stream; check shape.weights_gb / gpu.hbm_tb_per_s / "
                                 "decode_tokens_per_s")
        return s0 * self.compute_factor, s1 * self.compute_factor

    def kv_transfer_s(self, context_tokens: float) -> float:
        """Time to move one request's KV from a prefill to a decode replica over the GPUs' links."""
        return context_tokens * self.kv_bytes_per_token / (self.gpu.kv_link_gb_per_s * 1e9 * self.gpus_per_replica)

    def capacity(self, uncached_prompt: float, context: float, output: float, target_tokens_per_s: float,
                 role: str = "colocated") -> "Capacity":
        """Max requests/s per replica for requests of this shape (role: colocated | prefill | decode).

        `context` is the mean KV a decoding sequence holds (prompt + half the output)."""
        v, cf = target_tokens_per_s, self.compute_factor
        prefill_s = uncached_prompt / self.prefill_tokens_per_s * cf  # replica-s of prefill per request
        if role == "prefill":  # compute-bound, unless the links cannot ship the KV as fast
            link = self.gpu.kv_link_gb_per_s * 1e9 * self.gpus_per_replica / (context * self.kv_bytes_per_token)
            compute = 1.0 / max(prefill_s, 1e-9)
            return Capacity(min(compute, link), v, "prefill" if compute <= link else "kv-link", prefill_s)
        s0, s1 = self.step_curve(v)
        a = 0.0 if role == "decode" else prefill_s
        transfer = self.kv_transfer_s(context) if role == "decode" else 0.0
        kv_streams = self.kv_capacity_tokens / max(context, 1.0)
        # Decoding sequences per unit of arrival rate at speed u: O / u (+ the transfer while the KV lands).
        def kv_bound(u: float) -> float:
            return kv_streams / (output / u + transfer)
        if s0 * v < 1.0:
            speed_bound = (1.0 - s0 * v) / (s1 * output + a)
            if speed_bound <= kv_bound(v):
                return Capacity(speed_bound, v, "stream-speed", prefill_s)
            return Capacity(kv_bound(v), v, "kv-capacity", prefill_s)
        # The target speed is out of reach (fixed step >= 1 / v): run at the speed where the KV-limited
        # batch and the step time balance, i.e. the most throughput the replica has, and say so.
        lo, hi = 1e-3, 1.0 / s0
        for _ in range(60):
            u = (lo + hi) / 2
            lo, hi = (u, hi) if (1.0 - s0 * u) / (s1 * output + a) > kv_bound(u) else (lo, u)
        u = (lo + hi) / 2
        return Capacity(kv_bound(u), u, "unreachable-speed", prefill_s)

    def replica_seconds(self, uncached_prompt: float, output_tokens: float, target_tokens_per_s: float = 40.0,
                        context: float | None = None) -> float:
        """Replica-seconds one colocated request costs (1 / max sustainable rate)."""
        ctx = uncached_prompt + output_tokens / 2 if context is None else context
        return 1.0 / self.capacity(uncached_prompt, ctx, output_tokens, target_tokens_per_s).requests_per_s


@dataclass(frozen=True)
class Capacity:
    """One replica's sustainable rate, the stream speed it gives, and which bound set it."""

    requests_per_s: float
    stream_tokens_per_s: float
    bound: str  # stream-speed | kv-capacity | prefill | kv-link | unreachable-speed
    prefill_s: float  # replica-s of prefill per request (the TTFT model's service time)

    @property
    def replica_seconds(self) -> float:
        return 1.0 / self.requests_per_s


@dataclass(frozen=True)
class PeakSizing:
    """Replicas and GPUs one load needs at a target utilisation (the docs' peak estimate)."""

    requests_per_s: dict[str, float]
    busy_replicas: dict[str, float]
    replicas: dict[str, int]
    gpus: dict[str, int]
    target_utilisation: float
    total_gpus: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_gpus", sum(self.gpus.values()))


def replicas_for_work(work_replica_s_per_s: float, target_utilisation: float) -> int:
    """Replicas that keep a work rate (replica-seconds per second) at the target utilisation."""
    if work_replica_s_per_s <= 0:
        return 0
    return math.ceil(work_replica_s_per_s / target_utilisation - 1e-9)


def peak_sizing(models: list[ModelProfile], peak_requests_per_s: float, cost_per_request: dict[str, float],
                target_utilisation: float) -> PeakSizing:
    """GPUs the peak needs: per model, rate x replica-seconds per request / target utilisation x GPUs."""
    rps, busy, replicas, gpus = {}, {}, {}, {}
    for model in models:
        rps[model.name] = peak_requests_per_s * model.traffic_share
        busy[model.name] = rps[model.name] * cost_per_request[model.name]
        replicas[model.name] = replicas_for_work(busy[model.name], target_utilisation)
        gpus[model.name] = replicas[model.name] * model.gpus_per_replica
    return PeakSizing(rps, busy, replicas, gpus, target_utilisation)
