"""Usage metering under storage faults, on real files, a real tmpfs and a real broker: a full disk at a
spool segment roll, a damaged record header in a finished segment, an event the store cannot hold, and
the in-flight ledger that bills a stream whose router died."""
from __future__ import annotations

import json
import logging
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer

from usage import spool as spool_mod
from usage import store
from usage.inflight import InflightLedger
from usage.loader import UsageLoader
from usage.producer import UsageProducer
from usage.spool import HEADER, Spool


@pytest.fixture
def spool_log(caplog, monkeypatch):
    """caplog for usage.spool, even after another test's logging setup disabled or detached that logger."""
    logger = logging.getLogger("usage.spool")
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.ERROR, logger="usage.spool"):
        yield caplog


def _fill_until_error(sp: Spool, value: bytes, limit: int = 100_000) -> tuple[int, OSError]:
    for i in range(limit):
        try:
            sp.append(b"k", value)
        except OSError as exc:
            return i, exc
    raise AssertionError("the tiny filesystem never filled up")


def test_enospc_at_segment_roll_is_loud_and_does_not_wedge_later_appends(tiny_fs, monkeypatch, spool_log):
    # 1 MiB segments on a 3 MiB filesystem that something else has half filled: a roll finds no space.
    monkeypatch.setattr(spool_mod, "SEGMENT_BYTES", 1024 * 1024)
    monkeypatch.setattr(spool_mod, "MAX_RECORD", 256 * 1024)
    filler = tiny_fs / "other-data"
    filler.write_bytes(b"\0" * (1024 * 1024 + 512 * 1024))
    sp = Spool(tiny_fs / "spool")
    value = b"x" * 2000
    ok, exc = _fill_until_error(sp, value)
    assert exc.errno == 28, exc  # ENOSPC, raised to the caller (the router counts and logs it)
    assert sp.roll_failures == 1 and "cannot start segment" in spool_log.text
    assert sp.segments() == [1], "the half-made segment must not stay behind"
    with pytest.raises(OSError) as again:  # still full: the same clean failure, not FileExistsError
        sp.append(b"k", value)
    assert again.value.errno == 28
    filler.unlink()  # space comes back: appends work again, and nothing spooled before is lost
    sp.append(b"k", b"after")
    values = [r.value for r in sp.read_batch(100_000, max_bytes=64 * 1024 * 1024)]
    assert len(values) == ok + 1 and values[-1] == b"after"
    sp.close()


def test_bad_length_in_a_finished_segment_does_not_wedge_the_reader(tmp_path, spool_log):
    sp = Spool(tmp_path / "spool")
    for i in range(5):
        sp.append(b"k", f"old-{i}".encode())
    seg = sp._active
    first = sp.read_batch(1)[0]
    sp.close()
    # Damage the header of the third record of the (now finished) segment: an absurd length.
    path = tmp_path / "spool" / f"{seg:012d}.seg"
    data = bytearray(path.read_bytes())
    off = first.end.offset * 2
    length, crc = HEADER.unpack_from(data, off)
    assert length == first.end.offset - HEADER.size
    HEADER.pack_into(data, off, 0xFFFFFFF0, crc)
    path.write_bytes(bytes(data))
    sp = Spool(tmp_path / "spool")
    sp.append(b"k", b"new-0")
    values = [r.value for r in sp.read_batch(100)]
    assert values == [b"old-0", b"old-1", b"new-0"]  # the damaged rest is skipped, later segments flow
    assert sp.corrupt_skips >= 1 and "bad record length" in spool_log.text
    sp.close()


def _produce_and_load(bootstrap: str, store_path, topic: str, events) -> UsageLoader:
    """Send the events to the real broker, then run the real loader until it consumed them all."""
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for ev in events:
        producer.send(topic, key=b"alice", value=ev.to_json_bytes())
    producer.flush()
    producer.close()
    loader = UsageLoader(bootstrap, store_path, topic=topic, group_id=f"g-{topic}", dlq_topic=topic + ".dlq")
    try:
        consumed = 0
        for _ in range(20):
            consumed += loader.run_once(2.0)
            if consumed >= len(events):
                break
    finally:
        loader.close()
    assert consumed == len(events), loader.stats
    return loader


def test_event_the_store_cannot_hold_goes_to_the_dlq(kafka_bootstrap, tmp_path, topic, make_event):
    good, bad = make_event(), make_event(ts=1e300)  # schema-valid; ts * 1000 overflows the store's BIGINT
    loader = _produce_and_load(kafka_bootstrap, tmp_path / "u.duckdb", topic, [bad, good])
    assert loader.stats["rejected"] == 1 and loader.stats["inserted"] == 1, loader.stats
    with store.connect(tmp_path / "u.duckdb", read_only=True) as con:
        assert con.execute("SELECT request_id FROM usage_events").fetchall() == [(good.request_id,)]
        (reason,) = con.execute("SELECT reason FROM usage_rejects").fetchall()[0]
    assert reason.startswith("ts:"), reason
    dlq = KafkaConsumer(topic + ".dlq", bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                        consumer_timeout_ms=10_000)
    letters = [json.loads(m.value) for m in dlq]
    dlq.close()
    assert len(letters) == 1 and bad.request_id in letters[0]["raw"]


def test_store_refusal_of_one_row_dead_letters_only_that_row(kafka_bootstrap, tmp_path, topic, make_event,
                                                             monkeypatch):
    """The fallback behind the explicit checks: whatever else DuckDB refuses is found row by row."""
    import usage.loader as loader_mod
    monkeypatch.setattr(loader_mod, "MAX_TS", float("inf"))  # let ts=1e300 reach the store
    events = [make_event(), make_event(ts=1e300), make_event()]
    loader = _produce_and_load(kafka_bootstrap, tmp_path / "u.duckdb", topic, events)
    assert loader.stats["inserted"] == 2 and loader.stats["rejected"] == 1, loader.stats
    with store.connect(tmp_path / "u.duckdb", read_only=True) as con:
        ids = {r[0] for r in con.execute("SELECT request_id FROM usage_events").fetchall()}
        (reason,) = con.execute("SELECT reason FROM usage_rejects").fetchall()[0]
    assert ids == {events[0].request_id, events[2].request_id}
    assert "store refused" in reason


def test_ledger_entries_of_a_dead_producer_are_spooled_once(tmp_path, make_event):
    spool_dir = tmp_path / "spool"
    first = UsageProducer("127.0.0.1:1", spool_dir)  # never started: no broker needed
    ev = make_event(request_id=uuid.uuid4().hex, completion_tokens=0, status="error", finish_reason="error")
    slot = first.ledger.open(ev)
    first.ledger.progress(slot, 17)
    first.spool.close()  # the process "dies": nothing else is written, the files stay
    second = UsageProducer("127.0.0.1:1", spool_dir)
    got = [json.loads(r.value) for r in second.spool.read_batch(10)]
    assert [(g["request_id"], g["completion_tokens"], g["status"]) for g in got] == [(ev.request_id, 17, "error")]
    assert InflightLedger.leftovers(second.ledger) == []
    second.spool.close()
    third = UsageProducer("127.0.0.1:1", spool_dir)  # nothing is recovered twice
    assert [json.loads(r.value)["request_id"] for r in third.spool.read_batch(10)] == [ev.request_id]
    third.spool.close()
