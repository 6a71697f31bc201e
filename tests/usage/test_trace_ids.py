"""The request's trace id in its usage row: router (caller's traceparent) -> spool -> Kafka -> loader -> lake,
and a lake written before the column existed gains it (older rows read null)."""
from __future__ import annotations

import secrets

import httpx
import pandas as pd
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from common.processes import wait_until
from usage import store
from usage.lake import EVENTS, EVENTS_SCHEMA, OPTIONAL_EVENT_FIELDS, Lake, open_table


@pytest.mark.integration
def test_the_usage_row_carries_the_callers_trace_id(platform):
    trace_id = secrets.token_hex(16)
    body = {"model": "smollm2-135m", "max_tokens": 4, "temperature": 0, "prompt": "Name a colour."}
    headers = {"authorization": f"Bearer {platform.api_key}", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    resp = httpx.post(f"{platform.http_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    request_id = resp.headers["x-fleet-request-id"]

    def usage_row():
        with store.connect(platform.data_dir / "usage.duckdb", read_only=True) as con:
            return con.execute("SELECT trace_id, completion_tokens FROM usage_events WHERE request_id = ?",
                               [request_id]).fetchone()
    row = wait_until(usage_row, 120, "the usage row in the lake (router -> spool -> Kafka -> loader)")
    assert row == (trace_id, 4)


def test_a_lake_from_before_trace_ids_gains_the_column(tmp_path, make_event):
    lake = Lake(str(tmp_path / "usage.lake"))
    old_schema = pa.schema([f for f in EVENTS_SCHEMA if f.name not in dict(OPTIONAL_EVENT_FIELDS)])
    old = store.events_table([tuple(make_event("old").model_dump(exclude={"trace_id"}).values())])
    write_deltalake(lake.table_uri(EVENTS), old.select(old_schema.names).cast(old_schema), partition_by=["day"])
    assert "trace_id" not in open_table(lake, EVENTS).to_pyarrow_dataset().schema.names
    tid = secrets.token_hex(16)
    with store.connect(tmp_path / "usage.duckdb", lake=lake) as con:
        assert store.insert_events(con, pd.DataFrame([make_event("new", trace_id=tid).model_dump()])) == 1
        rows = con.execute("SELECT request_id, trace_id FROM usage_events ORDER BY request_id").fetchall()
    assert rows == [("new", tid), ("old", None)]


def test_a_malformed_trace_id_is_refused_naming_the_field(make_event):
    with pytest.raises(ValueError, match="trace_id"):
        make_event(trace_id="not-hex")
