"""Soft state pushed by replicas every ~200 ms: load, KV blocks, cached prefix hashes
(docs/architecture.md, State reports).

Losing it costs only routing quality: entries older than `stale_after_s` are ignored and the router
falls back to round-robin with per-replica concurrency caps (see `replica_choice`).

Reports lag by up to one interval, so the router also remembers the prompt blocks it has just sent to a
replica ("pending" hashes, kept for `pending_ttl_s`): a multi-turn conversation's second turn arriving
100 ms after the first still lands where its prefix is being cached.

Reports are validated against `ReplicaReport` (common/replica_report.py, the schema the engine builds them
with: strict types, bounded sizes) before they touch routing state.

Replicas that cannot report prefix hashes (GPU replicas: tensorrtllm_backend exposes no KV-cache events; their
reports say `prefix_hashes_reported: false`) are judged on that routed-prefix history alone, kept for
`history_ttl_s` instead of `pending_ttl_s`.

Progress: a report's `steps` counter (engine steps completed) tells a slow replica from a hung one
(docs/reliability.md, Slow is not dead). `progressing` is true while reports are fresh and the counter moved
within the window asked for; reports are built on the engine's loop thread between steps, so a replica
whose process is stopped or whose loop is stuck stops reporting, and one whose loop idles reports a
counter that does not move.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.replica_report import DEFAULT_BLOCK_SIZE, ReplicaReport

log = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    report: dict
    received_at: float
    prefix_hashes: set[int] = field(default_factory=set)
    progress_at: float | None = None  # monotonic time a report last showed the step counter moving

    @property
    def block_size(self) -> int:
        return int(self.report.get("block_size") or DEFAULT_BLOCK_SIZE)

    @property
    def adapters(self) -> set[str]:
        return set(self.report.get("adapters_loaded") or ())


class ReplicaStateTable:
    def __init__(self, stale_after_s: float = 2.0, pending_ttl_s: float = 5.0, history_ttl_s: float = 300.0) -> None:
        self.stale_after_s = stale_after_s
        self.pending_ttl_s = pending_ttl_s
        self.history_ttl_s = history_ttl_s
        self.states: dict[str, ReplicaState] = {}
        self.pending: dict[str, dict[int, float]] = {}  # replica -> hash -> monotonic time routed
        self.full_snapshots: dict[str, float] = {}       # replica -> monotonic time of its last full snapshot

    def apply(self, report: dict | ReplicaReport) -> None:
        """Take one report (validated against ReplicaReport; pydantic.ValidationError if it does not fit)."""
        if not isinstance(report, ReplicaReport):
            report = ReplicaReport.model_validate(report)
        replica_id = report.replica_id
        report = report.model_dump()
        now = time.monotonic()
        state = self.states.get(replica_id)
        before = None if state is None else state.report.get("steps")
        progress_at = None if state is None else state.progress_at
        if state is None or report.get("full_snapshot"):
            if state is None:
                log.info("first state report from replica %s", replica_id)
            state = self.states[replica_id] = ReplicaState(report, now, set(report.get("prefix_hashes") or ()),
                                                           progress_at)
            self.full_snapshots[replica_id] = now
        steps = report.get("steps")
        if steps is not None and (before is None or steps != before):
            state.progress_at = now  # a restart resets the counter: any change is movement
        state.prefix_hashes.update(report.get("prefix_hashes_added") or ())
        state.prefix_hashes.difference_update(report.get("prefix_hashes_removed") or ())
        state.report, state.received_at = report, now

    def fresh(self, replica_id: str) -> ReplicaState | None:
        state = self.states.get(replica_id)
        if state is None or time.monotonic() - state.received_at > self.stale_after_s:
            return None
        return state

    def progressing(self, replica_id: str, window_s: float, fresh_s: float) -> bool:
        """The replica's last report is at most `fresh_s` old and its engine completed a step within the last
        `window_s` seconds: busy, not hung. False for a reporter without a step counter (judged by timeouts
        alone). Reports come between steps, so `fresh_s` must exceed the longest step a slow replica takes."""
        state = self.states.get(replica_id)
        now = time.monotonic()
        return state is not None and state.progress_at is not None and now - state.received_at <= fresh_s \
            and now - state.progress_at <= window_s

    def note_routed(self, replica_id: str, hashes: list[int]) -> None:
        """Remember that these prompt blocks are about to be cached on replica_id."""
        if not hashes:
            return
        now = time.monotonic()
        pending = self.pending.setdefault(replica_id, {})
        for h in hashes:
            pending[h] = now
        if len(pending) > 50_000:  # bound memory: drop expired entries
            cutoff = now - self._ttl(replica_id)
            self.pending[replica_id] = {h: t for h, t in pending.items() if t >= cutoff}

    def _ttl(self, replica_id: str) -> float:
        state = self.states.get(replica_id)
        blind = state is not None and state.report.get("prefix_hashes_reported") is False
        return self.history_ttl_s if blind else self.pending_ttl_s

    def cached_blocks(self, replica_id: str, hashes: list[int]) -> int:
        """Leading prompt blocks that replica_id has cached (reported) or was just sent (pending)."""
        state = self.fresh(replica_id)
        cached = state.prefix_hashes if state is not None else ()
        pending = self.pending.get(replica_id) or {}
        cutoff = time.monotonic() - self._ttl(replica_id)
        n = 0
        for h in hashes:
            if h in cached:
                n += 1
                continue
            t = pending.get(h)
            if t is None or t < cutoff:
                break
            n += 1
        return n

    def summary(self, replica_id: str) -> dict:
        state = self.fresh(replica_id)
        if state is None:
            return {"reporting": False}
        keys = ("kv_blocks_total", "kv_blocks_free", "block_size", "running", "waiting", "queue_wait_ms_p95",
                "ttft_ms_p95", "tokens_per_s", "adapters_loaded", "draining")
        return {"reporting": True, "report_age_ms": round((time.monotonic() - state.received_at) * 1000),
                "cached_prefix_blocks": len(state.prefix_hashes), **{k: state.report.get(k) for k in keys}}
