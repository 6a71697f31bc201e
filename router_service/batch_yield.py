"""How batch work yields to interactive work of the same model version.

Two modes (FLEET_ROUTER_BATCH_YIELD):
- `share` (default; for GPU replicas whose engines schedule by priority): batch streams may hold at most
  `batch_share` of each replica's slots, so interactive arrivals always find a free slot, and batch is
  admitted from the queue only while no interactive or standard request waits.
- `preempt` (for replicas that share CPU cores, as on the development machines, where any batch decode
  slows every interactive step): while interactive requests are in flight, or arrived in the last
  `grace_s`, no batch stream starts, and an interactive arrival preempts the running batch streams.
  A preempted stream is not failed: the router re-queues it and later resumes it from prompt + tokens
  already emitted (the same path as resume after a replica failure), so its caller sees only a pause.
"""
from __future__ import annotations

import logging
import time

from router_service import metrics
from router_service.cancellation import CancelHandle

log = logging.getLogger(__name__)
MODES = ("share", "preempt")
DEFAULT_GRACE_S = 0.5


class BatchYield:
    def __init__(self, mode: str = "share", grace_s: float = DEFAULT_GRACE_S) -> None:
        self.mode = mode
        if self.mode not in MODES:
            raise ValueError(f"FLEET_ROUTER_BATCH_YIELD must be one of {', '.join(MODES)}, not {self.mode!r}")
        self.grace_s = grace_s
        self.interactive_active: dict[str, int] = {}
        self.interactive_seen: dict[str, float] = {}
        self.running_batch: dict[str, set[CancelHandle]] = {}

    def batch_may_start(self, key: str) -> bool:
        if self.mode != "preempt":
            return True
        if self.interactive_active.get(key, 0) > 0:
            return False
        return time.monotonic() - self.interactive_seen.get(key, 0.0) >= self.grace_s

    def interactive_arrived(self, key: str) -> None:
        """An interactive request was admitted: in `preempt` mode, running batch streams step aside."""
        self.interactive_seen[key] = time.monotonic()
        if self.mode != "preempt":
            return
        running = self.running_batch.get(key) or set()
        for handle in list(running):
            if not handle.preempted:
                handle.preempt()
                metrics.PREEMPTIONS.labels(key.split(":")[0]).inc()
        if running:
            log.info("preempted %d batch streams of %s for interactive work", len(running), key)

    def interactive_started(self, key: str) -> None:
        self.interactive_active[key] = self.interactive_active.get(key, 0) + 1

    def interactive_ended(self, key: str) -> None:
        self.interactive_active[key] = max(0, self.interactive_active.get(key, 0) - 1)
        self.interactive_seen[key] = time.monotonic()

    def batch_started(self, key: str, handle: CancelHandle) -> None:
        self.running_batch.setdefault(key, set()).add(handle)

    def batch_ended(self, key: str, handle: CancelHandle) -> None:
        self.running_batch.get(key, set()).discard(handle)
