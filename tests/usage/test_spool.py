"""The durable spool: order, acknowledgement, reopen after a crash, torn records, replay, exclusivity."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import usage.spool as spool_mod
from usage.spool import HEADER, Spool


@pytest.fixture
def small_segments(monkeypatch):
    monkeypatch.setattr(spool_mod, "SEGMENT_BYTES", 1 << 16)  # exercise rolling over segments


def drain(sp: Spool, batch: int = 97) -> list[bytes]:
    out = []
    while recs := sp.read_batch(batch):
        out += [r.value for r in recs]
        sp.ack(recs[-1].end, len(recs))
    return out


def test_order_ack_and_segment_cleanup(tmp_path, small_segments):
    sp = Spool(tmp_path)
    values = [b"v%05d" % i + b"x" * 100 for i in range(2000)]
    for i, v in enumerate(values):
        sp.append(b"k%d" % (i % 3), v)
    assert sp.pending() == 2000
    assert len(sp.segments()) > 2
    assert drain(sp) == values
    assert sp.pending() == 0
    assert len(sp.segments()) <= 2  # acknowledged segments are deleted
    sp.close()


def test_reopen_resends_only_unacknowledged(tmp_path, small_segments):
    sp = Spool(tmp_path)
    for i in range(500):
        sp.append(b"k", b"%d" % i)
    recs = sp.read_batch(200)
    sp.ack(recs[-1].end, len(recs))
    sp.close()
    sp2 = Spool(tmp_path)
    assert sp2.pending() == 300
    assert drain(sp2) == [b"%d" % i for i in range(200, 500)]
    sp2.append(b"k", b"after")
    assert drain(sp2) == [b"after"]
    sp2.close()


def test_killed_writer_loses_nothing_and_torn_tail_is_skipped(tmp_path):
    code = ("import sys, os; sys.path.insert(0, %r); from usage.spool import Spool\n"
            "s = Spool(%r)\nfor i in range(1000): s.append(b'k', b'%%d' %% i)\nos._exit(9)\n"
            ) % (os.getcwd(), str(tmp_path))
    subprocess.run([sys.executable, "-c", code], check=False)
    # Simulate a power-cut tear after the last record: a header whose body never made it.
    seg = tmp_path / ("%012d.seg" % 1)
    data = seg.read_bytes()
    end = data.index(bytes(HEADER.size * 4))  # first run of zeros = end of data
    with open(seg, "r+b") as f:
        f.seek(end)
        f.write(HEADER.pack(50, 12345) + b"partial")
    sp = Spool(tmp_path)
    assert sp.pending() == 1000
    sp.append(b"k", b"new")
    assert drain(sp) == [b"%d" % i for i in range(1000)] + [b"new"]
    sp.close()


def test_rewind_replays_the_window(tmp_path):
    sp = Spool(tmp_path, replay_window_s=60)
    for i in range(10):
        sp.append(b"k", b"%d" % i)
    assert drain(sp, batch=4) == [b"%d" % i for i in range(10)]
    assert sp.rewind() == 10 and sp.pending() == 10
    assert drain(sp) == [b"%d" % i for i in range(10)]
    sp.close()


def test_one_writer_per_spool(tmp_path):
    sp = Spool(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        Spool(tmp_path)
    sp.close()
    Spool(tmp_path).close()


def test_append_is_fast(tmp_path):
    sp = Spool(tmp_path)
    value = b"x" * 400
    lat = []
    for _ in range(20000):
        t0 = time.perf_counter()
        sp.append(b"caller", value)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    # The 0.2 ms p99 target is measured by bench/usage/bench_usage.py; here only a loose guard (shared CPUs).
    assert lat[int(len(lat) * 0.99)] < 0.001
    sp.close()


def test_reader_reads_only_what_was_written(tmp_path, monkeypatch):
    """The active segment is preallocated: a read stops at the writer's position, not at the read limit,
    and records appended after a read are found by the next one."""
    sp = Spool(tmp_path)
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(spool_mod.os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    sp.append(b"k", b"a" * 100)
    first = sp.read_batch(10)
    assert [r.value for r in first] == [b"a" * 100]
    sp.ack(first[-1].end, 1)
    sp.append(b"k", b"b" * 100)
    sp.append(b"k", b"c" * 100)
    assert [r.value for r in sp.read_batch(10)] == [b"b" * 100, b"c" * 100]
    assert reads and max(reads) < 1024          # two records' bytes, never megabytes of empty segment
    sp.close()
