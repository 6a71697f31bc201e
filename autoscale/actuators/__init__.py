"""Actuators turn a desired replica count into running replicas: local processes or Kubernetes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PoolSpec:
    """One scalable pool: a model version in a region, with its GPU shape."""

    model: str
    version: str
    region: str = "local"
    tensor_parallel: int = 1
    adapters: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.version}".lower().replace("_", "-").replace(".", "-")


@dataclass
class ReplicaCounts:
    serving: int = 0
    starting: int = 0
    draining: int = 0
    cordoned: int = 0  # running but cordoned by a router: missing capacity, not counted in `total`

    @property
    def total(self) -> int:
        """Replicas that count toward the desired number (draining ones are on their way out)."""
        return self.serving + self.starting


class Actuator(Protocol):
    def counts(self, pool: PoolSpec) -> ReplicaCounts: ...

    def scale(self, pool: PoolSpec, desired: int) -> None: ...

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        """p90 of measured cold starts for this pool's model, None when none were measured yet."""
        ...
