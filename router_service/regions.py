"""Regions: each region serves its own callers; only batch work overflows to another region.

A caller's home region is its registry `region` (or the router's own region when the caller has
none). Interactive and standard requests only ever use home-region replicas; batch requests use the
home region first and other regions' replicas only when no home replica has room.
"""
from __future__ import annotations

from collections.abc import Sequence

from router_service.registry_cache import ReplicaInfo


def home_region(caller_region: str | None, router_region: str) -> str:
    return caller_region or router_region


def candidate_tiers(replicas: Sequence[ReplicaInfo], home: str, tier: str) -> list[list[ReplicaInfo]]:
    """Replica groups to try in order: [home] for interactive/standard, [home, other regions] for batch."""
    own = [r for r in replicas if r.region == home]
    if tier != "batch":
        return [own]
    return [own, [r for r in replicas if r.region != home]]
