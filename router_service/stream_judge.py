"""What the router does when a stream's first-token or inter-token timeout passes (docs/reliability.md,
Slow is not dead): keep waiting on the same upstream call, or give the replica up as hung.

- The replica's state reports show its engine stepping (`ReplicaStateTable.progressing`): it is slow, not
  dead. The stream keeps waiting (up to `Healing.slow_limit_s`) and the replica is held from new work until
  the stream's next response (back-pressure: new requests wait in the admission queue).
- It stopped reporting (or its step counter stands still) and it is the last usable replica of its model
  version: it is suspect, never cordoned on timeouts alone. The stream keeps waiting (up to
  `Healing.recover_wait_s`) while the prober tries it (router_service/replica_probe.py).
- Otherwise: hung (`stream_guard.guarded` raises ReplicaHung; the router cordons it and resumes elsewhere).
"""
from __future__ import annotations

import logging

from router_service import metrics
from router_service.registry_cache import ModelInfo
from router_service.replica_probe import Healing
from router_service.replica_set import ReplicaSet
from router_service.replica_state import ReplicaStateTable

log = logging.getLogger(__name__)


class StreamJudge:
    """Called by `guarded` as judge(got_token, waited_s, limit_s) -> keep waiting?"""

    def __init__(self, states: ReplicaStateTable, replicas: ReplicaSet, healing: Healing, model: ModelInfo,
                 request_id: str, replica_id: str) -> None:
        self.states, self.replicas, self.healing = states, replicas, healing
        self.model, self.request_id, self.replica_id = model, request_id, replica_id
        self.waited = False   # a timeout passed and the stream kept waiting
        self.slowing = False  # counted in ReplicaSet.slow (holds the replica back) until `settle`
        self.logged = False   # one log line per stream, however often a tiny timeout passes

    def __call__(self, got_token: bool, waited_s: float, limit_s: float) -> bool:
        rid = self.replica_id
        # a slow replica reports once per step: allow steps of up to twice the routing staleness bound (4 s)
        fresh_s = 2 * self.states.stale_after_s
        if self.states.progressing(rid, max(limit_s, fresh_s), fresh_s) and waited_s < self.healing.slow_limit_s:
            if not self.slowing:
                self.slowing = True
                self.replicas.slow_begin(rid)
            metrics.SLOW_WAITS.labels(rid).inc()
            if not self.logged:
                self.logged = True
                log.warning("replica %s is slow, not hung: %s waited %.1f s for a token while its engine kept "
                            "stepping; it gets no new work while it stays slow", rid, self.request_id, waited_s)
            self.waited = True
            return True
        if waited_s < self.healing.recover_wait_s and self.replicas.is_last(self.model, rid):
            self.replicas.suspect_replica(rid, f"{self.request_id} got no token for {waited_s:.1f} s and the "
                                               f"replica sends no state reports")
            self.waited = True
            return True
        return False

    def settle(self) -> None:
        """The replica answered after a wait (or the attempt ended): it is neither held for this stream nor
        suspect any more."""
        if self.waited:
            self.waited = False
            self.replicas.answered(self.replica_id)
        self.settle_hold()

    def settle_hold(self) -> None:
        """The attempt ended: this stream no longer holds the replica back (a suspicion stays)."""
        if self.slowing:
            self.slowing = False
            self.replicas.slow_end(self.replica_id)
