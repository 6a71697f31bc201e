"""Which cordoned replicas an actuator should restart: one rule for local processes and Kubernetes pods.

A router cordons a replica that stopped reporting and stalled its streams, then probes it with backoff and
uncordons it when a probe answers (router_service/replica_probe.py). A replica still cordoned after
`restart_after_s` is one whose probes keep failing: its actuator restarts it (a new process, or a new pod by
deleting the stuck one). Only a router's cordon counts: the last `replica_*` audit row of the replica must be
`replica_cordoned` by `router`; a cordon an operator set is the operator's to lift.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from registry.db import session_scope
from registry.queries import list_replicas
from registry.schema import AuditLog

log = logging.getLogger(__name__)


def cordoned_replicas(db_url: str, model: str, version: str) -> set[str]:
    """Ids of the model version's replicas whose registry row is `cordoned` (empty when unreadable)."""
    try:
        with session_scope(db_url) as session:
            return {r.replica_id for r in list_replicas(session, model)
                    if r.version == version and r.state == "cordoned"}
    except SQLAlchemyError as exc:  # registry unreadable: count by the actuator's own bookkeeping meanwhile
        log.warning("cannot read cordoned replicas of %s %s from the registry: %s", model, version, exc)
        return set()


class CordonWatch:
    """Remembers since when each running replica has been seen cordoned; says which are due for a restart."""

    def __init__(self, restart_after_s: float) -> None:
        self.restart_after_s = restart_after_s
        self.since: dict[str, float] = {}  # replica id -> monotonic time first seen cordoned

    def due(self, db_url: str, running: Iterable[str], cordoned: set[str], now: float | None = None) -> list[str]:
        """The running replicas a router cordoned at least restart_after_s ago (forgotten once returned)."""
        now = time.monotonic() if now is None else now
        running = list(running)
        for replica_id in running:
            if replica_id in cordoned:
                self.since.setdefault(replica_id, now)
            else:
                self.since.pop(replica_id, None)
        for gone in set(self.since) - set(running):
            del self.since[gone]
        due = [r for r in running if now - self.since.get(r, now) >= self.restart_after_s]
        if not due:
            return []
        with session_scope(db_url) as session:
            stuck = [r for r in due if _cordoned_by_router(session, r)]
        for replica_id in stuck:
            self.since.pop(replica_id, None)
        return stuck


def _cordoned_by_router(session, replica_id: str) -> bool:
    last = session.scalars(select(AuditLog).where(AuditLog.target == replica_id, AuditLog.action.like("replica_%"))
                           .order_by(AuditLog.id.desc()).limit(1)).first()
    return last is not None and last.actor == "router" and last.action == "replica_cordoned"
