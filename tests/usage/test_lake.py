"""The usage lake under load: readers query while the loader commits (never blocked, never half a batch),
the same loader and readers through an S3 URI (moto's S3 server, a real HTTP object store), and retention."""
from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pandas as pd
import pytest
from kafka import KafkaProducer

from common.processes import free_port, stop_pid
from common.settings import load_settings
from usage import chargeback, retention, store
from usage.lake import EVENT_FIELDS, EVENTS, Lake, LakeSettings, open_table
from usage.loader import UsageLoader

pytestmark = pytest.mark.integration


def _produce(bootstrap: str, topic: str, events) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for ev in events:
        producer.send(topic, key=ev.key(), value=ev.to_json_bytes())
    producer.flush(30)
    producer.close()


def _load(loader: UsageLoader, store_path, lake, expected: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loader.run_once(1.0)
        with store.connect(store_path, read_only=True, lake=lake) as con:
            if con.execute("SELECT count(*) FROM usage_events").fetchall()[0][0] >= expected:
                return
    raise AssertionError(f"not all {expected} events loaded: {loader.stats}")


def test_readers_never_block_nor_see_half_a_batch(kafka_bootstrap, tmp_path, topic, make_event):
    n = 24_000
    _produce(kafka_bootstrap, topic, [make_event(f"r-{i}", caller=f"c{i % 3}") for i in range(n)])
    path = tmp_path / "u.duckdb"
    loader = UsageLoader(kafka_bootstrap, path, topic=topic, group_id=f"g-{topic}", dlq_topic=f"{topic}.dlq",
                         batch_max=2000)
    seen: list[tuple[float, dict[int, int], int]] = []  # (query seconds, rows per batch, rollup requests)
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            with store.connect(path, read_only=True, timeout_s=2) as con:
                per_batch = dict(con.execute("SELECT load_seq, count(*) FROM usage_events GROUP BY 1").fetchall())
                req = con.execute("SELECT coalesce(sum(requests), 0) FROM usage_rollups").fetchall()[0][0]
            seen.append((time.perf_counter() - t0, per_batch, int(req)))
            time.sleep(0.02)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        _load(loader, path, None, n)
    finally:
        done.set()
        for r in readers:
            r.join(timeout=30)
        loader.close()
    with store.connect(path, read_only=True) as con:
        final = dict(con.execute("SELECT load_seq, count(*) FROM usage_events GROUP BY 1").fetchall())
    assert sum(final.values()) == n and len(final) >= 5, final
    growing = {sum(b.values()) for _, b, _ in seen}
    assert len(growing) >= 3, f"the readers did not run while batches were committed: {sorted(growing)}"
    for secs, per_batch, req in seen:
        # Every batch a reader saw, it saw whole; rollups never ran ahead of the events they sum.
        assert all(final[seq] == rows for seq, rows in per_batch.items()), (per_batch, final)
        assert req <= n
    assert max(s for s, _, _ in seen) < 2.0, "a reader waited on the writer"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """moto's S3 server (real HTTP, S3 API) on a free port, with an empty bucket."""
    # moto lives in its own folder (scripts/install.sh): its botocore pins a python-dateutil our venv cannot take
    moto_dir = load_settings().vendor_dir / "moto"
    if not (moto_dir / "moto" / "server.py").exists():
        pytest.skip(f"moto[server] is not installed in {moto_dir} (scripts/install.sh installs it)")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(moto_dir)},
                            start_new_session=True)  # its own group: stop_pid below signals the group
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.2)
    httpx.put(f"http://127.0.0.1:{port}/usage").raise_for_status()  # S3 CreateBucket (moto checks no signature)
    yield f"http://127.0.0.1:{port}"
    stop_pid(proc.pid)


def test_loader_and_readers_through_an_s3_uri(kafka_bootstrap, tmp_path, topic, make_event, s3_server):
    settings = LakeSettings(usage_lake_uri="s3://usage/lake", aws_endpoint_url=s3_server, aws_access_key_id="test",
                            aws_secret_access_key="test", usage_lake_allow_http=True)
    lake = Lake(settings.usage_lake_uri, settings.storage_options())
    events = [make_event(f"s3-{i}", team=f"t{i % 2}", ts=time.time() - 3600 * (i % 3)) for i in range(3000)]
    _produce(kafka_bootstrap, topic, events + events[:500])  # a resend: stored once
    path = tmp_path / "control.duckdb"
    loader = UsageLoader(kafka_bootstrap, path, topic=topic, group_id=f"g-{topic}", dlq_topic=f"{topic}.dlq",
                         lake=lake, batch_max=1000)
    try:
        _load(loader, path, lake, 3000)
        for _ in range(2):
            loader.run_once(1.0)  # the resent tail
    finally:
        loader.close()
    assert not (tmp_path / "control.lake").exists(), "nothing may land on local disk"
    with store.connect(path, read_only=True, lake=lake) as con:
        rows, distinct = con.execute("SELECT count(*), count(DISTINCT request_id) FROM usage_events").fetchall()[0]
    assert rows == distinct == 3000
    # A second reader with its own connection: chargeback (rollups) agrees with the raw rows.
    import usage.lake as lake_mod
    old = lake_mod._settings
    lake_mod._settings = settings  # what FLEET_USAGE_LAKE_URI + AWS_* give a reader pod
    try:
        by_team = chargeback.usage_summary(path, group_by=("team",))
    finally:
        lake_mod._settings = old
    assert by_team["requests"].tolist() == [1500, 1500]
    assert by_team["decode_tokens"].sum() == sum(e.completion_tokens for e in events)


def test_retention_and_compaction_keep_rollup_totals(tmp_path, make_event):
    path = tmp_path / "u.duckdb"
    today = dt.datetime.now(dt.UTC).date()
    noon = dt.datetime.combine(today - dt.timedelta(days=1), dt.time(12), dt.UTC).timestamp()
    frames = [pd.DataFrame([make_event(f"b{b}-{i}", ts=noon - 40 * 86400 * (i % 4 == 0) + i).model_dump()
                            for i in range(40)]) for b in range(3)]
    with store.connect(path) as con:
        for frame in frames:
            store.insert_events(con, frame)
    before = chargeback.usage_summary(path, group_by=())
    done = retention.maintain(store.lake_for(path), today=today)
    after = chargeback.usage_summary(path, group_by=())
    # yesterday's three batch files are merged (the expired day went first)
    assert done["compacted_rollup_days"] == 2 and done["compacted_event_days"] == 1, done
    assert len(open_table(store.lake_for(path), EVENTS).file_uris()) == 1
    assert after.equals(before), (before, after)  # rollups (13 months) keep the expired raw days' totals
    with store.connect(path, read_only=True) as con:
        raw = con.execute("SELECT count(*), min(day) FROM usage_events").fetchall()[0]
        files = con.execute("SELECT count(*) FROM usage_rollups").fetchall()[0][0]
    assert raw[0] == 90 and raw[1] >= today - dt.timedelta(days=35)  # 30 expired with their day
    assert files == 2  # one merged row per (hour, dimensions) per day


def test_a_pre_lake_store_moves_into_the_lake_once(tmp_path, make_event):
    """A control file from before the lake (usage_events with its PRIMARY KEY, usage_rejects): its rows move
    into the lake on the first writable open, and chargeback sees them."""
    import duckdb
    path = tmp_path / "usage.duckdb"
    events = [make_event(f"old-{i}", team=f"t{i % 3}") for i in range(2500)]
    con = duckdb.connect(str(path))
    cols = ", ".join(store.EVENT_COLUMNS)
    sql_type = {"string": "VARCHAR", "int64": "BIGINT", "double": "DOUBLE"}
    ddl = ", ".join(f"{name} {sql_type[str(t)]} NOT NULL" for name, t in EVENT_FIELDS)
    con.execute(f"CREATE TABLE usage_events ({ddl}, day DATE NOT NULL, PRIMARY KEY (request_id))")  # the old table
    con.execute("CREATE TABLE usage_rejects (id VARCHAR PRIMARY KEY, rejected_at TIMESTAMP, reason VARCHAR, raw VARCHAR)")
    frame = pd.DataFrame([e.model_dump() for e in events])
    con.execute(f"INSERT INTO usage_events SELECT {cols}, CAST(to_timestamp(ts) AS DATE) FROM frame")
    con.execute("INSERT INTO usage_rejects VALUES ('t/0/1/x', now(), 'bad', '{}')")
    con.close()
    with store.connect(path):
        pass
    with store.connect(path):  # a second open finds nothing left to move
        pass
    with store.connect(path, read_only=True) as con:
        assert con.execute("SELECT count(*), count(DISTINCT request_id) FROM usage_events").fetchall()[0] == (2500, 2500)
        assert con.execute("SELECT count(*) FROM usage_rejects").fetchall()[0][0] == 1
        legacy = con.execute("SELECT count(*) FROM duckdb_tables() WHERE NOT temporary "
                             "AND table_name = 'usage_events'").fetchall()[0][0]
    assert legacy == 0
    by_team = chargeback.usage_summary(path, group_by=("team",))
    assert by_team["requests"].tolist() == [834, 833, 833]
    assert by_team["decode_tokens"].sum() == sum(e.completion_tokens for e in events)
