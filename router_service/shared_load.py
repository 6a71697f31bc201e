"""Streams on a replica as every router sees them: the replica's last report counts every router's streams
(`running` + `waiting`, ~200 ms old); this router adds its own streams placed since that report.

    streams(replica) = others + own
    others = max(0, reported running + waiting - own streams placed before the report and still in flight)

so N routers do not each fill a replica to `replica_concurrency`, and the cost function's load term carries the
other routers' streams (at this router's mean tokens per stream) besides this router's exact token load.
Without a fresh report a router knows only its own streams (the fallback of replica_choice). The error is the
report's age: streams other routers placed since the last report (~200 ms) are not yet seen.
"""
from __future__ import annotations

import itertools
import time

from router_service.replica_state import ReplicaStateTable

_ids = itertools.count()


class SharedLoad:
    def __init__(self, states: ReplicaStateTable) -> None:
        self.states = states
        # replica -> placement id -> monotonic time placed (insertion order = time order, removals keep it)
        self.placed: dict[str, dict[int, float]] = {}
        # replica -> (report time, own placements changed count, others): a pump offers slots to every waiting
        # request, each asking every replica; between reports and placements the answer does not change
        self._cache: dict[str, tuple[float, int, int]] = {}
        self._changes: dict[str, int] = {}

    def opened(self, replica_id: str) -> int:
        pid = next(_ids)
        self.placed.setdefault(replica_id, {})[pid] = time.monotonic()
        self._changes[replica_id] = self._changes.get(replica_id, 0) + 1
        return pid

    def closed(self, replica_id: str, pid: int) -> None:
        if self.placed.get(replica_id, {}).pop(pid, None) is not None:
            self._changes[replica_id] = self._changes.get(replica_id, 0) + 1

    def others(self, replica_id: str) -> int:
        """Streams of other routers on the replica at its last fresh report (0 without one)."""
        state = self.states.fresh(replica_id)
        if state is None:
            return 0
        changes = self._changes.get(replica_id, 0)
        cached = self._cache.get(replica_id)
        if cached is not None and cached[0] == state.received_at and cached[1] == changes:
            return cached[2]
        reported = int(state.report.get("running") or 0) + int(state.report.get("waiting") or 0)
        mine_then = 0
        for at in self.placed.get(replica_id, {}).values():   # in time order: stop at the first after the report
            if at >= state.received_at:
                break
            mine_then += 1
        others = max(0, reported - mine_then)
        self._cache[replica_id] = (state.received_at, changes, others)
        return others
