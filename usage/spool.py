"""A durable local spool: append-only segment files plus an acknowledged-position file.

Why segment files and not SQLite: `append()` sits on the router's request path and must cost well
under 0.2 ms at p99. One `os.write` of a framed record into an O_APPEND file costs a few microseconds
and, once it returns, the record is in the kernel and survives a crash or SIGKILL of the router.
Power-loss durability comes from group commit: the reader (the producer's sender thread) fsyncs a
segment before it sends the records it read from it, so nothing reaches Kafka that is not on disk,
and the window for a machine crash is the sender's cycle (tens of ms), never the request path.

Layout in the spool dir:
    000000000001.seg ...   records `>II` (body length, crc32 of body) + body
                           body = `>H` key length + key + value
    ack                    "SEGNO OFFSET": everything before this position was acknowledged by Kafka
Each process that opens the spool starts a fresh segment, so a record torn by a crash can only sit at
the tail of an older, finished segment, where the reader skips it. Segments below the acknowledged
position are deleted. One writer process per spool dir (guarded with an flock).
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct(">II")
KEYLEN = struct.Struct(">H")
SEGMENT_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, order=True)
class Position:
    segment: int
    offset: int


@dataclass
class Record:
    key: bytes
    value: bytes
    end: Position  # position just after this record


def _seg_name(n: int) -> str:
    return f"{n:012d}.seg"


class Spool:
    """Append from any thread; read and acknowledge from one reader thread."""

    def __init__(self, spool_dir: Path) -> None:
        self.dir = Path(spool_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # Two routers writing one spool would interleave segment numbers; refuse instead.
        self._lock_fd = os.open(self.dir / "LOCK", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"spool {self.dir} is in use by another process") from None
        self._lock = threading.Lock()
        self._read_fd: int | None = None
        self._read_seg = -1
        segs = self.segments()
        self._acked = self._read_ack(segs)
        self._pending = sum(1 for _ in self._scan_from(self._acked, segs))
        # Never reuse a number at or below the acknowledged segment, even if every file is gone.
        self._active = max(segs[-1] if segs else 0, self._acked.segment) + 1
        self._fd = os.open(self.dir / _seg_name(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        self._fsync_dir()

    # ---- writer side (request path) ------------------------------------------------------------
    def append(self, key: bytes, value: bytes) -> None:
        body = KEYLEN.pack(len(key)) + key + value
        rec = HEADER.pack(len(body), zlib.crc32(body)) + body
        with self._lock:
            os.write(self._fd, rec)  # one syscall: a record is never half-visible after a process kill
            self._size += len(rec)
            self._pending += 1
            if self._size >= SEGMENT_MAX_BYTES:
                self._roll()

    def _roll(self) -> None:
        os.close(self._fd)
        self._active += 1
        self._fd = os.open(self.dir / _seg_name(self._active), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0

    def pending(self) -> int:
        with self._lock:
            return self._pending

    # ---- reader side (sender thread) -----------------------------------------------------------
    def segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.seg"))

    def read_batch(self, max_records: int, max_bytes: int = 4 * 1024 * 1024) -> list[Record]:
        """Unacknowledged records in append order, starting at the acknowledged position, fsync'd."""
        out: list[Record] = []
        size = 0
        for rec in self._scan_from(self._acked, None, read_limit=max_bytes + 65536):
            out.append(rec)
            size += len(rec.value)
            if len(out) >= max_records or size >= max_bytes:
                break
        return out

    def ack(self, pos: Position, count: int) -> None:
        """The `count` records before pos were acknowledged by the broker: persist that, drop old segments."""
        with self._lock:
            self._pending -= count
        self._acked = pos
        tmp = self.dir / "ack.tmp"
        with open(tmp, "w") as f:
            f.write(f"{pos.segment} {pos.offset}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "ack")
        removed = False
        for seg in self.segments():
            if seg < pos.segment:
                (self.dir / _seg_name(seg)).unlink(missing_ok=True)
                removed = True
        if removed:
            self._fsync_dir()

    def close(self) -> None:
        with self._lock:
            os.fsync(self._fd)
            os.close(self._fd)
        if self._read_fd is not None:
            os.close(self._read_fd)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)

    # ---- internals -----------------------------------------------------------------------------
    def _read_ack(self, segs: list[int]) -> Position:
        try:
            seg, off = (self.dir / "ack").read_text().split()
            return Position(int(seg), int(off))
        except (FileNotFoundError, ValueError):
            return Position(segs[0], 0) if segs else Position(0, 0)

    def _scan_from(self, start: Position, segs: list[int] | None, read_limit: int | None = None):
        """Yield complete records from start on. A short or corrupt record ends a segment: at the tail of
        the active segment it is a write still in flight (stop); in a finished one it is a crash tear."""
        segs = self.segments() if segs is None else segs
        for seg in segs:
            if seg < start.segment:
                continue
            offset = start.offset if seg == start.segment else 0
            data, truncated = self._segment_bytes(seg, offset, read_limit)
            pos = 0
            while pos + HEADER.size <= len(data):
                length, crc = HEADER.unpack_from(data, pos)
                body = data[pos + HEADER.size: pos + HEADER.size + length]
                if len(body) < length or zlib.crc32(body) != crc:
                    break
                pos += HEADER.size + length
                (klen,) = KEYLEN.unpack_from(body, 0)
                yield Record(bytes(body[2:2 + klen]), bytes(body[2 + klen:]), Position(seg, offset + pos))
            if truncated or seg >= self._active_segment():
                return  # the rest comes with the next read; never skip past the segment being written

    def _active_segment(self) -> int:
        return getattr(self, "_active", 1 << 62)

    def _segment_bytes(self, seg: int, offset: int, limit: int | None) -> tuple[memoryview, bool]:
        """Bytes of a segment from offset (at most limit), fsync'd first so what we send is on disk."""
        if seg != self._read_seg:
            if self._read_fd is not None:
                os.close(self._read_fd)
            try:
                self._read_fd = os.open(self.dir / _seg_name(seg), os.O_RDONLY)
            except FileNotFoundError:
                self._read_fd, self._read_seg = None, -1
                return memoryview(b""), False
            self._read_seg = seg
        os.fsync(self._read_fd)
        avail = max(0, os.fstat(self._read_fd).st_size - offset)
        n = avail if limit is None else min(avail, limit)
        return memoryview(os.pread(self._read_fd, n, offset)), n < avail

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
