"""Soft state pushed by replicas every ~200 ms (DESIGN.md §4): load, KV blocks, cached prefix hashes.

Losing it costs only routing quality: entries older than `stale_after_s` are ignored and the router
falls back to its own in-flight counts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    report: dict
    received_at: float
    prefix_hashes: set[int] = field(default_factory=set)


class ReplicaStateTable:
    def __init__(self, stale_after_s: float = 2.0) -> None:
        self.stale_after_s = stale_after_s
        self.states: dict[str, ReplicaState] = {}

    def apply(self, report: dict) -> None:
        replica_id = str(report.get("replica_id") or "")
        if not replica_id:
            raise ValueError("replica_id: required in a state report")
        state = self.states.get(replica_id)
        if state is None or report.get("full_snapshot"):
            state = self.states[replica_id] = ReplicaState(report, time.monotonic(),
                                                           set(report.get("prefix_hashes") or ()))
        state.prefix_hashes.update(report.get("prefix_hashes_added") or ())
        state.prefix_hashes.difference_update(report.get("prefix_hashes_removed") or ())
        state.report, state.received_at = report, time.monotonic()

    def fresh(self, replica_id: str) -> ReplicaState | None:
        state = self.states.get(replica_id)
        if state is None or time.monotonic() - state.received_at > self.stale_after_s:
            return None
        return state

    def summary(self, replica_id: str) -> dict:
        state = self.fresh(replica_id)
        if state is None:
            return {"reporting": False}
        keys = ("kv_blocks_total", "kv_blocks_free", "block_size", "running", "waiting", "queue_wait_ms_p95",
                "ttft_ms_p95", "tokens_per_s", "adapters_loaded", "draining")
        return {"reporting": True, "cached_prefix_blocks": len(state.prefix_hashes),
                **{k: state.report.get(k) for k in keys}}
