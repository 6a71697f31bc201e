"""Placement: bin-packing replicas onto 8-GPU nodes in two regions.

Rules:
- a replica needs `gpus` GPUs on ONE node (a tensor-parallel-4 replica needs 4 free GPUs on one node;
  on an 8-GPU node they are taken as an aligned NVLink half, GPUs 0-3 or 4-7, when one is free);
- best fit: the node with the fewest free GPUs that still fits, so small replicas fill partial nodes
  first and whole nodes stay empty for TP groups (or can be powered down / lent to training);
- scale-down drains the replica on the emptiest node first, so nodes consolidate and free up.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """Where one replica runs: region, node index and the GPU indices it holds."""

    region: str
    node: int
    gpu_ids: tuple[int, ...]

    @property
    def node_name(self) -> str:
        return f"{self.region}-node-{self.node:03d}"


@dataclass
class RegionNodes:
    """Free-GPU bitmap of every node in one region."""

    name: str
    nodes: int
    gpus_per_node: int = 8
    used: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.used = np.zeros((self.nodes, self.gpus_per_node), dtype=bool)

    @property
    def free_per_node(self) -> np.ndarray:
        return self.gpus_per_node - self.used.sum(axis=1)

    def _gpu_ids(self, node: int, gpus: int) -> tuple[int, ...] | None:
        free = np.flatnonzero(~self.used[node])
        if len(free) < gpus:
            return None
        if gpus > 1 and self.gpus_per_node % gpus == 0:  # prefer an aligned group (NVLink half)
            for start in range(0, self.gpus_per_node, gpus):
                if not self.used[node, start:start + gpus].any():
                    return tuple(range(start, start + gpus))
        return tuple(int(g) for g in free[:gpus])

    def place(self, gpus: int) -> Slot | None:
        """Best fit: the fullest node that still has `gpus` free GPUs; None if no node fits."""
        free = self.free_per_node
        order = np.argsort(np.where(free >= gpus, free, self.gpus_per_node + 1), kind="stable")
        for node in order:
            if free[node] < gpus:
                break
            ids = self._gpu_ids(int(node), gpus)
            if ids is not None:
                self.used[node, list(ids)] = True
                return Slot(self.name, int(node), ids)
        return None

    def release(self, slot: Slot) -> None:
        self.used[slot.node, list(slot.gpu_ids)] = False


class Cluster:
    """All regions' nodes; the simulator and the Kubernetes actuator place replicas through it."""

    def __init__(self, regions: dict[str, tuple[int, int]]) -> None:
        self.regions = {name: RegionNodes(name, nodes, per_node) for name, (nodes, per_node) in regions.items()}

    def place(self, region: str, gpus: int) -> Slot | None:
        slot = self.regions[region].place(gpus)
        if slot is None:
            log.debug("no node in %s has %d free GPUs on one node", region, gpus)
        return slot

    def release(self, slot: Slot) -> None:
        self.regions[slot.region].release(slot)

    def free_replicas(self, region: str, gpus: int) -> int:
        """How many more replicas of `gpus` GPUs fit in a region (whole replicas per node)."""
        return int((self.regions[region].free_per_node // gpus).sum())

    def busiest_node(self, region: str) -> int:
        """The node with the most GPUs in use (the failure that hurts most)."""
        return int(np.argmax(self.regions[region].used.sum(axis=1)))

    def fail_node(self, region: str, node: int) -> None:
        """A node goes down: all its GPUs are taken until repair_node (its replicas are lost by their pools)."""
        self.regions[region].used[node, :] = True

    def repair_node(self, region: str, node: int) -> None:
        self.regions[region].used[node, :] = False

    def drain_order(self, slots: list[Slot]) -> list[Slot]:
        """Replicas in the order to drain: emptiest node first, so whole nodes free up."""
        free = {name: nodes.free_per_node for name, nodes in self.regions.items()}
        return sorted(slots, key=lambda s: (-int(free[s.region][s.node]), s.node))

    def summary(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, nodes in self.regions.items():
            free = nodes.free_per_node
            out[name] = {"gpus": int(nodes.used.size), "used": int(nodes.used.sum()),
                         "empty_nodes": int((free == nodes.gpus_per_node).sum()),
                         "partial_nodes": int(((free > 0) & (free < nodes.gpus_per_node)).sum()),
                         "full_nodes": int((free == 0).sum())}
        return out


def pack(cluster: Cluster, requests: list[tuple[str, int, int]]) -> dict[str, list[Slot]]:
    """Place (region, gpus_per_replica, count) requests, largest replicas first; returns slots per request key."""
    out: dict[str, list[Slot]] = {}
    for region, gpus, count in sorted(requests, key=lambda r: -r[1]):
        key = f"{region}/{gpus}"
        for _ in range(count):
            slot = cluster.place(region, gpus)
            if slot is None:
                break
            out.setdefault(key, []).append(slot)
    return out
