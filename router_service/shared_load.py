"""Streams on a replica as every router sees them: the replica's last report counts every router's streams
(`running` + `waiting`, ~200 ms old); this router adds its own streams placed since that report.

    streams(replica) = others + own
    others = max(0, reported running + waiting - own streams in flight at the report's time)

so N routers do not each fill a replica to `replica_concurrency`, and the cost function's load term carries the
other routers' streams (at this router's mean tokens per stream) besides this router's exact token load.
Without a fresh report a router knows only its own streams (the fallback of replica_choice). The error is the
report's age: streams other routers placed since the last report (~200 ms) are not yet seen.

"Own streams in flight at the report's time" counts those placed before it and closed after it too: short
streams (one token) often end between two reports, and leaving them out counted them as other routers'
streams, a phantom load on the replica this router had just used, which its bounded-load cap then avoided
(a second copy of a prefix on another replica).
"""
from __future__ import annotations

import itertools
import math
import time

from router_service.replica_state import ReplicaStateTable

_ids = itertools.count()


class SharedLoad:
    def __init__(self, states: ReplicaStateTable) -> None:
        self.states = states
        # replica -> placement id -> [monotonic time placed, time closed (inf while open)]; insertion order =
        # time order; a closed entry is kept until a report newer than its close has been read
        self.placed: dict[str, dict[int, list[float]]] = {}
        # replica -> (report time, own placements changed count, others): a pump offers slots to every waiting
        # request, each asking every replica; between reports and placements the answer does not change
        self._cache: dict[str, tuple[float, int, int]] = {}
        self._changes: dict[str, int] = {}

    def opened(self, replica_id: str) -> int:
        pid = next(_ids)
        self.placed.setdefault(replica_id, {})[pid] = [time.monotonic(), math.inf]
        self._changes[replica_id] = self._changes.get(replica_id, 0) + 1
        return pid

    def closed(self, replica_id: str, pid: int) -> None:
        entry = self.placed.get(replica_id, {}).get(pid)
        if entry is not None and entry[1] == math.inf:
            entry[1] = time.monotonic()
            self._changes[replica_id] = self._changes.get(replica_id, 0) + 1
            placed = self.placed[replica_id]
            if len(placed) > 4096:   # bound memory while no report is read (others() prunes as it reads one)
                state = self.states.states.get(replica_id)
                since = state.received_at if state is not None else math.inf
                for old in [k for k, (_, closed) in placed.items() if closed < since]:
                    del placed[old]

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
        placed = self.placed.get(replica_id, {})
        for pid in [pid for pid, (_, closed) in placed.items() if closed < state.received_at]:
            del placed[pid]   # ended before this report: no report from now on counts it
        mine_then = 0
        for opened, _closed in placed.values():   # in time order: stop at the first after the report
            if opened >= state.received_at:
                break
            mine_then += 1                         # open at the report (closed ones left end after it)
        others = max(0, reported - mine_then)
        self._cache[replica_id] = (state.received_at, changes, others)
        return others
