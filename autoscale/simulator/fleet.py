"""Fleet model: each pool's replicas move starting -> serving -> draining -> released on placed GPUs.

Scale-up places a replica (best fit on one node) and it serves after a cold start drawn from the
model's range; scale-down first cancels replicas still starting, then drains serving replicas on the
emptiest nodes (the router stops admitting, streams finish within `drain_s`, then the GPUs free up).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autoscale.capacity import ModelProfile
from autoscale.placement import Cluster, Slot


@dataclass
class PoolFleet:
    region: str
    model: ModelProfile
    cluster: Cluster
    rng: np.random.Generator
    drain_s: float
    serving: list[Slot] = field(default_factory=list)
    starting: list[tuple[float, Slot]] = field(default_factory=list)
    draining: list[tuple[float, Slot]] = field(default_factory=list)
    starts: int = 0
    drains: int = 0
    placement_failures: int = 0
    lost_to_failure: int = 0
    capacity_limited_steps: int = 0  # steps the policy wanted more replicas than the region had room for
    cold_starts_s: list[float] = field(default_factory=list)
    _cold_estimate: float | None = None

    @property
    def total(self) -> int:
        return len(self.serving) + len(self.starting)

    @property
    def allocated_gpus(self) -> int:
        return (len(self.serving) + len(self.starting) + len(self.draining)) * self.model.gpus_per_replica

    def bootstrap(self, replicas: int) -> None:
        """Start the run with replicas already serving (no cold start)."""
        for _ in range(replicas):
            slot = self.cluster.place(self.region, self.model.gpus_per_replica)
            if slot is None:
                self.placement_failures += 1
                break
            self.serving.append(slot)

    def advance(self, now_s: float) -> None:
        """Replicas whose cold start finished begin serving; drained replicas free their GPUs."""
        ready = [s for s in self.starting if s[0] <= now_s]
        if ready:
            self.starting = [s for s in self.starting if s[0] > now_s]
            self.serving.extend(slot for _, slot in ready)
        done = [s for s in self.draining if s[0] <= now_s]
        if done:
            self.draining = [s for s in self.draining if s[0] > now_s]
            for _, slot in done:
                self.cluster.release(slot)

    def scale_to(self, desired: int, now_s: float) -> None:
        if desired > self.total:
            for _ in range(desired - self.total):
                slot = self.cluster.place(self.region, self.model.gpus_per_replica)
                if slot is None:
                    self.placement_failures += 1
                    break
                cold = float(self.rng.uniform(*self.model.cold_start_s))
                self.cold_starts_s.append(cold)
                self._cold_estimate = None
                self.starting.append((now_s + cold, slot))
                self.starts += 1
        elif desired < self.total:
            surplus = self.total - desired
            while surplus and self.starting:  # cancel the newest start first: no streams to drain
                _, slot = self.starting.pop()
                self.cluster.release(slot)
                surplus -= 1
            if surplus:
                order = self.cluster.drain_order(self.serving)[:surplus]
                chosen = {id(s) for s in order}
                self.serving = [s for s in self.serving if id(s) not in chosen]
                self.draining.extend((now_s + self.drain_s, s) for s in order)
                self.drains += len(order)

    def lose_node(self, node: int) -> int:
        """Drop every replica (serving, starting or draining) on a failed node; returns how many."""
        def keep(slot: Slot) -> bool:
            return slot.node != node

        before = len(self.serving) + len(self.starting) + len(self.draining)
        self.serving = [s for s in self.serving if keep(s)]
        self.starting = [s for s in self.starting if keep(s[1])]
        self.draining = [s for s in self.draining if keep(s[1])]
        lost = before - len(self.serving) - len(self.starting) - len(self.draining)
        self.lost_to_failure += lost
        return lost

    def cold_start_estimate(self) -> float:
        """Cold-start time the controller plans with: p90 of measured starts, else the model's upper bound."""
        if self._cold_estimate is None:
            self._cold_estimate = (float(np.percentile(self.cold_starts_s[-50:], 90)) if len(self.cold_starts_s) >= 5
                                   else float(self.model.cold_start_s[1]))
        return self._cold_estimate
