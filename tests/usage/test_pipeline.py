"""Producer -> real tansu broker -> loader -> DuckDB: exactly-once rows, dead letters, redelivery."""
from __future__ import annotations

import json
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer

from usage import store
from usage.loader import UsageLoader
from usage.producer import UsageProducer

pytestmark = pytest.mark.integration


def load_all(loader: UsageLoader, store_path, expected: int, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    rows = 0
    while time.monotonic() < deadline:
        loader.run_once(1.0)
        with store.connect(store_path, read_only=True) as con:
            rows = con.execute("SELECT count(*) FROM usage_events").fetchone()[0]
        if rows >= expected:
            break
    return rows


def test_emit_flush_load_exactly_once(kafka_bootstrap, tmp_path, topic, make_event):
    producer = UsageProducer(kafka_bootstrap, tmp_path / "spool", topic=topic).start()
    events = [make_event(f"req-{i}", caller=f"caller-{i % 5}", team=f"team-{i % 2}", ts=1793491200.0 + i)
              for i in range(3000)]
    for ev in events:
        producer.emit(ev)
    assert producer.flush(30) and producer.pending() == 0
    producer.close()
    loader = UsageLoader(kafka_bootstrap, tmp_path / "u.duckdb", topic=topic, group_id=f"g-{topic}",
                         dlq_topic=f"{topic}.dlq")
    assert load_all(loader, tmp_path / "u.duckdb", 3000) == 3000
    loader.close()
    with store.connect(tmp_path / "u.duckdb", read_only=True) as con:
        row = con.execute("SELECT caller, team, prompt_tokens, cached_prompt_tokens, completion_tokens, "
                          "CAST(day AS VARCHAR) FROM usage_events WHERE request_id = 'req-7'").fetchone()
        assert row == ("caller-2", "team-1", 100, 40, 20, "2026-11-01")
        assert con.execute("SELECT count(DISTINCT request_id) FROM usage_events").fetchone()[0] == 3000


def test_bad_events_go_to_dead_letter_topic_and_loader_continues(kafka_bootstrap, tmp_path, topic, make_event):
    raw = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    good = make_event("good-1").model_dump()
    bad = {
        "missing": {k: v for k, v in good.items() if k != "completion_tokens"} | {"request_id": "bad-1"},
        "negative": good | {"request_id": "bad-2", "prompt_tokens": -5},
        "unknown caller": good | {"request_id": "bad-3", "caller": "mallory"},
        "cached > prompt": good | {"request_id": "bad-4", "cached_prompt_tokens": 500},
    }
    raw.send(topic, key=b"alice", value=json.dumps(good).encode())
    for value in bad.values():
        raw.send(topic, key=b"x", value=json.dumps(value).encode())
    raw.send(topic, key=b"x", value=b"{not json")
    raw.send(topic, key=b"alice", value=make_event("good-2").to_json_bytes())
    raw.flush()
    raw.close()
    loader = UsageLoader(kafka_bootstrap, tmp_path / "u.duckdb", topic=topic, group_id=f"g-{topic}",
                         dlq_topic=f"{topic}.dlq", known_callers=lambda: {"alice"})
    assert load_all(loader, tmp_path / "u.duckdb", 2) == 2
    loader.close()
    assert loader.stats["rejected"] == 5 and loader.stats["inserted"] == 2
    with store.connect(tmp_path / "u.duckdb", read_only=True) as con:
        reasons = [r[0] for r in con.execute("SELECT reason FROM usage_rejects").fetchall()]
    assert len(reasons) == 5
    dlq = KafkaConsumer(f"{topic}.dlq", bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                        consumer_timeout_ms=5000)
    letters = [json.loads(m.value) for m in dlq]
    dlq.close()
    assert len(letters) == 5
    text = " | ".join(letter["reason"] for letter in letters)
    assert "completion_tokens" in text and "greater than or equal to 0" in text
    assert "unknown caller 'mallory'" in text and "cached_prompt_tokens exceeds" in text and "json" in text.lower()
    assert all("raw" in letter and "source" in letter for letter in letters)


def test_crash_between_write_and_commit_gives_no_duplicates(kafka_bootstrap, tmp_path, topic, make_event):
    producer = UsageProducer(kafka_bootstrap, tmp_path / "spool", topic=topic).start()
    for i in range(500):
        producer.emit(make_event(f"r-{i}"))
    assert producer.flush(30)
    producer.close()
    kw = dict(topic=topic, group_id=f"g-{topic}", dlq_topic=f"{topic}.dlq")
    first = UsageLoader(kafka_bootstrap, tmp_path / "u.duckdb", **kw)

    class Crash(Exception):
        pass

    def crash(*_args, **_kwargs):
        raise Crash

    first._ensure_consumer().commit = crash  # the batch is written, then the process "dies"
    with pytest.raises(Crash):
        while True:
            first.run_once(2.0)
    first._consumer.close(autocommit=False)
    second = UsageLoader(kafka_bootstrap, tmp_path / "u.duckdb", **kw)
    assert load_all(second, tmp_path / "u.duckdb", 500) == 500
    deadline = time.monotonic() + 30
    while second.stats["consumed"] < 500 and time.monotonic() < deadline:
        second.run_once(1.0)
    second.close()
    assert second.stats["duplicates"] > 0  # the batch came again and was dropped on request_id
    with store.connect(tmp_path / "u.duckdb", read_only=True) as con:
        assert con.execute("SELECT count(*) FROM usage_events").fetchone()[0] == 500


def test_emit_never_waits_for_a_dead_broker(tmp_path, make_event):
    from common.processes import free_port
    producer = UsageProducer(f"127.0.0.1:{free_port()}", tmp_path / "spool").start()
    t0 = time.perf_counter()
    for i in range(1000):
        producer.emit(make_event(f"r-{i}"))
    assert time.perf_counter() - t0 < 1.0
    assert not producer.flush(1.0)
    assert producer.pending() == 1000
    producer.close(timeout_s=0.1)
