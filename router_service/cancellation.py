"""Requests in flight by id, so `POST /v1/requests/{id}/cancel` can stop one from another connection.

A cancelled request ends with finish_reason `cancelled`: if it waits in the admission queue it leaves
the queue; if it streams, the upstream gRPC call to the replica is cancelled so the engine frees its
KV blocks at once.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(eq=False)
class CancelHandle:
    request_id: str
    caller: str
    cancelled: bool = False
    preempted: bool = False  # set by batch_yield; the stream is re-queued, not ended
    event: asyncio.Event = field(default_factory=asyncio.Event)
    upstream: object | None = None  # the live upstream call (has .cancel())

    def preempt(self) -> None:
        self.preempted = True
        if self.upstream is not None:
            self.upstream.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self.event.set()
        if self.upstream is not None:
            self.upstream.cancel()


class InflightRequests:
    def __init__(self) -> None:
        self.handles: dict[str, CancelHandle] = {}

    def register(self, request_id: str, caller: str) -> CancelHandle:
        handle = self.handles[request_id] = CancelHandle(request_id, caller)
        return handle

    def unregister(self, handle: CancelHandle) -> None:
        if self.handles.get(handle.request_id) is handle:
            del self.handles[handle.request_id]

    def cancel(self, request_id: str, caller: str) -> bool:
        """Cancel the caller's own request; False if no such request is in flight for this caller."""
        handle = self.handles.get(request_id)
        if handle is None or handle.caller != caller:
            return False
        log.info("request %s cancelled by id", request_id)
        handle.cancel()
        return True
