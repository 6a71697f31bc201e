"""Per-replica capacity model: how much GPU time a request costs and how many replicas a load needs.

A replica is `gpus_per_replica` GPUs serving one model. Its throughput is described by two
calibratable numbers: prefill tokens/s and decode tokens/s (aggregate over the continuous batch at
the batch size that still meets the per-stream tokens/s target). A request with P prompt and O output
tokens costs P/prefill + O/decode replica-seconds (times a LoRA slowdown for adapter traffic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelProfile:
    """Throughput and start-up assumptions for one model pool (see simulator/assumptions.json)."""

    name: str
    gpus_per_replica: int
    traffic_share: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_capacity_tokens: float
    cold_start_s: tuple[float, float]
    lora_traffic_share: float = 0.0
    lora_slowdown: float = 1.0
    adapters: int = 0
    min_idle_replicas: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelProfile":
        fields = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        fields["cold_start_s"] = tuple(fields["cold_start_s"])
        return cls(**fields)

    @property
    def compute_factor(self) -> float:
        """Average slowdown of a batch that mixes base and LoRA requests (S-LoRA style kernels)."""
        return 1.0 + self.lora_traffic_share * (self.lora_slowdown - 1.0)

    def replica_seconds(self, prompt_tokens: float, output_tokens: float) -> float:
        """GPU-time (in replica-seconds) that one request of this size costs."""
        return (prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s) * self.compute_factor

    def tokens_per_replica_second(self, prompt_tokens: float, output_tokens: float) -> float:
        return (prompt_tokens + output_tokens) / self.replica_seconds(prompt_tokens, output_tokens)


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


def peak_sizing(models: list[ModelProfile], peak_requests_per_s: float, prompt_mean: float,
                output_mean: float, target_utilisation: float) -> PeakSizing:
    """GPUs the peak needs: per model, rate x cost per request / target utilisation, times GPUs per replica."""
    rps, busy, replicas, gpus = {}, {}, {}, {}
    for model in models:
        rps[model.name] = peak_requests_per_s * model.traffic_share
        busy[model.name] = rps[model.name] * model.replica_seconds(prompt_mean, output_mean)
        replicas[model.name] = replicas_for_work(busy[model.name], target_utilisation)
        gpus[model.name] = replicas[model.name] * model.gpus_per_replica
    return PeakSizing(rps, busy, replicas, gpus, target_utilisation)
