"""Version choice for a request: the registry's percent split, shifted by readiness, sticky per caller/session.

A rollout never sends traffic to a version with nothing serving: each routed version keeps
`percent x min(1, ready / needed)` of the traffic (`needed`: its warm buffer's `min_replicas`, at least 1,
own or inherited from its model). The pending rest goes to the split's fully ready versions in proportion
to their shares; else to a fully ready routable version outside the split (the one a promote replaced);
else to partly ready ones; else to anything that serves. When nothing serves at all, the configured split
stands and requests wait for starting replicas or fail fast (see `replica_set.ReplicaSet.must_wait`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from registry.queries import ROUTABLE_STATUSES
from router_service.registry_cache import ReplicaInfo, Snapshot


@dataclass(frozen=True)
class VersionReadiness:
    """One version of a model's rollout as the router sees it in one region."""
    version: str
    percent: int          # configured share of the split
    ready: int            # serving replicas in the router's snapshot (not cordoned)
    needed: int           # replicas the version needs before it takes its whole share
    effective: float = 0.0  # share it actually gets now, after readiness

    @property
    def pending(self) -> float:
        """Configured share it cannot take yet (0 for versions outside the split)."""
        return max(0.0, self.percent - self.effective) if self.percent else 0.0

    def note(self) -> str:
        """e.g. "v2: 0 of 1 replicas ready, 20 % pending" (what the admin API and UI show)."""
        text = f"v{self.version}: " + (f"{self.ready} of {self.needed} replicas ready" if self.ready <= self.needed
                                         else f"{self.ready} replicas ready")
        if self.pending >= 0.05:
            return f"{text}, {self.pending:.0f} % pending"
        if self.effective > self.percent:
            return f"{text}, carrying {self.effective:.0f} % (configured {self.percent} %)"
        return f"{text}, {self.effective:.0f} %"


def shift_by_readiness(split: dict[str, int], ready: dict[str, tuple[int, int]]) -> list[VersionReadiness]:
    """The effective split: `ready` maps every version that may take traffic (the split's versions and
    other routable ones) to (ready replicas, needed replicas). Returns one entry per version in `ready`."""
    own = {v: split.get(v, 0) * min(1.0, r / max(1, n)) for v, (r, n) in ready.items()}
    pending = sum(p for v, p in split.items() if v in ready) - sum(own.values())
    if pending > 0:
        def full(v: str) -> bool:
            return ready[v][0] >= max(1, ready[v][1])
        outside = [v for v, (r, _) in ready.items() if r > 0 and v not in split]
        # first the split's fully ready versions, then fully ready ones outside it (the version a promote
        # replaced), then partly ready ones, then anything that serves
        takers = ({v: e for v, e in own.items() if e > 0 and full(v)} or {v: 1.0 for v in outside if full(v)}
                  or {v: e for v, e in own.items() if e > 0} or {v: 1.0 for v in outside})
        if takers:
            total = sum(takers.values())
            own = {v: e + pending * takers.get(v, 0.0) / total for v, e in own.items()}
        else:  # nothing serves at all: the configured split stands
            own = {v: float(split.get(v, 0)) for v in ready}
    return [VersionReadiness(v, split.get(v, 0), r, max(1, n), round(own[v], 3))
            for v, (r, n) in sorted(ready.items())]


DEFAULT_GATE_PERCENT = 10  # FLEET_ROUTER_ROLLOUT_GATE_PERCENT: a version may take at most this share ungated


def ramp_gate_problems(before: Mapping[str, int], after: Mapping[str, int],
                       gates: Mapping[str, Mapping[str, Any]], limit: int) -> list[str]:
    """The promotion rule: a version whose share grows past `limit` % needs a passed quality gate (`gates`:
    version -> registry.quality.gate_summary). Lowering a share, or a version already above the limit not
    growing, is never refused (rolling back must always work). Empty = allowed."""
    problems = []
    for version, percent in sorted(after.items()):
        if percent <= limit or percent <= before.get(version, 0):
            continue
        gate = gates.get(version) or {}
        if gate.get("passed") is True:
            continue
        why = "; ".join(gate.get("failures") or ["no quality-gate report"])
        problems.append(f"version {version!r} has no passed quality gate ({why}); it may take at most {limit} % "
                        f"until it passes (asked {percent} %)")
    return problems


def pick_version(split: dict[str, float], sticky_key: str) -> str:
    """Deterministic: the same key lands on the same version while the split stays the same, and a
    share change moves only the keys whose bucket crosses a boundary. Shares need not sum to 100."""
    weights = {v: w for v, w in split.items() if w > 0}
    if not weights:
        raise ValueError("empty split")
    total = sum(weights.values())
    bucket = int.from_bytes(hashlib.sha256(sticky_key.encode()).digest()[:8], "big") % 10_000
    edge = 0.0
    for version in sorted(weights):
        edge += weights[version] * 10_000 / total
        if bucket < edge:
            return version
    return sorted(weights)[-1]


def rollout_readiness(snapshot: Snapshot, model: str, region: str,
                      usable: Callable[[ReplicaInfo], bool]) -> list[VersionReadiness]:
    """Readiness of every version of `model` that may take traffic in `region`: the split's versions and
    the other routable ones (`usable`: a serving replica the router would admit to)."""
    split = snapshot.routes.get(model, {})
    versions = snapshot.models.get(model, {})
    ready: dict[str, tuple[int, int]] = {}
    for version, info in versions.items():
        if version not in split and info.status not in ROUTABLE_STATUSES:
            continue
        serving = sum(1 for r in snapshot.replicas if r.model == model and r.version == version
                      and r.region == region and usable(r))
        pool = snapshot.pools.get((model, version))
        ready[version] = (serving, pool.min_replicas if pool is not None else 1)
    return shift_by_readiness(split, ready)
