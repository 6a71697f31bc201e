"""The in-flight usage ledger: what a router that dies mid-stream still owes the bill.

A request's usage event is spooled when its stream ends. If the router process dies first (kill -9, OOM,
a node loss with the spool volume kept), that event would never be written and the tokens already
streamed would go unbilled. So while a stream runs, its event (as it would read if the stream ended now)
sits in a slot of this memory-mapped file, and every streamed token updates the slot's token count: one
8-byte store into the page cache, which survives the death of the process. The stream's end spools the
real event and frees the slot. The next router to open the spool finds the slots still in use, spools
their events (status and finish_reason `error`, the last recorded token count) and frees them.

Exactly once: a slot is freed right after its event is spooled; a crash between the two spools the same
request_id twice, which the loader de-duplicates.

Layout: SLOTS slots of SLOT_BYTES; slot = `>QdI` (completion tokens, unix time of the last token, JSON
length; 0 = free) + the event's JSON. Aligned 8-byte stores, so a kill never tears the token count.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from pathlib import Path

from usage.events import UsageEvent

log = logging.getLogger(__name__)

SLOTS = 4096
SLOT_BYTES = 1024
HEAD = struct.Struct(">QdI")
COUNT = struct.Struct(">Qd")


class InflightLedger:
    """Slots for the streams in flight of one router (one writer process: the spool's flock guards it)."""

    def __init__(self, path: Path, slots: int = SLOTS) -> None:
        self.path = Path(path)
        self.slots = slots
        size = slots * SLOT_BYTES
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._free = [i for i in range(slots - 1, -1, -1) if not self._length(i)]
        self.full_misses = 0  # streams that found no free slot (they are billed only when they end)

    def _length(self, slot: int) -> int:
        return HEAD.unpack_from(self._mm, slot * SLOT_BYTES)[2]

    def open(self, event: UsageEvent) -> int | None:
        """Reserve a slot holding `event` (its completion_tokens is updated by progress()); None if full."""
        body = event.to_json_bytes()
        if len(body) > SLOT_BYTES - HEAD.size:
            log.warning("usage event of %s too large for the in-flight ledger (%d bytes)", event.request_id, len(body))
            return None
        with self._lock:
            if not self._free:
                self.full_misses += 1
                return None
            slot = self._free.pop()
        off = slot * SLOT_BYTES
        self._mm[off + HEAD.size: off + HEAD.size + len(body)] = body
        HEAD.pack_into(self._mm, off, event.completion_tokens, time.time(), len(body))  # visible last
        return slot

    def progress(self, slot: int, completion_tokens: int) -> None:
        COUNT.pack_into(self._mm, slot * SLOT_BYTES, completion_tokens, time.time())

    def close(self, slot: int) -> None:
        HEAD.pack_into(self._mm, slot * SLOT_BYTES, 0, 0.0, 0)
        with self._lock:
            self._free.append(slot)

    def leftovers(self) -> list[tuple[int, UsageEvent]]:
        """(slot, event) of streams a dead router left open, as they stood at its last token."""
        out = []
        for slot in range(self.slots):
            off = slot * SLOT_BYTES
            tokens, ts, length = HEAD.unpack_from(self._mm, off)
            if not length:
                continue
            try:
                event = UsageEvent.model_validate_json(bytes(self._mm[off + HEAD.size: off + HEAD.size + length]))
            except ValueError as exc:  # unreadable slot: free it, and say so
                log.error("in-flight ledger slot %d is unreadable (%s); dropped", slot, exc)
                self.close(slot)
                continue
            out.append((slot, event.model_copy(update={
                "completion_tokens": tokens, "ts": ts or event.ts, "finish_reason": "error", "status": "error",
                "duration_ms": max(event.duration_ms, round((ts - event.ts) * 1000, 3)) if ts else event.duration_ms})))
        return out

    def flush_and_close(self) -> None:
        self._mm.flush()
        self._mm.close()
