"""registry/warm_buffers.py: validation, audit and registry-version bump (SQLite and PostgreSQL)."""
import pytest

from registry import queries
from registry.db import migrate, session_scope
from registry.warm_buffers import get_warm_buffer, set_warm_buffer, warm_buffer_problems

GOOD = dict(min_idle_replicas=1, min_replicas=1, max_replicas=3, slo_ttft_ms_p95=500, slo_tokens_per_s=40)


def test_problems_name_the_field():
    assert warm_buffer_problems(**GOOD) == {}
    assert "greater than max_replicas" in warm_buffer_problems(**{**GOOD, "min_replicas": 4})["min_replicas"]
    assert "0 or more" in warm_buffer_problems(**{**GOOD, "slo_tokens_per_s": -1})["slo_tokens_per_s"]
    assert "min_idle_replicas" in warm_buffer_problems(**{**GOOD, "min_idle_replicas": 9})


def test_set_warm_buffer_audits_and_bumps_version(db_url):
    migrate(db_url)
    with session_scope(db_url) as s:
        queries.upsert_model_version(s, "m", "1", status="serving")
        before = queries.registry_version(s)
    with session_scope(db_url) as s:
        set_warm_buffer(s, "m", "1", **GOOD, actor="operator")
    with session_scope(db_url) as s:
        row = get_warm_buffer(s, "m", "1")
        assert (row.min_idle_replicas, row.max_replicas) == (1, 3)
        assert queries.registry_version(s) > before
        newest = queries.list_audit(s, 1)[0]
        assert (newest.action, newest.target, newest.before, newest.after) == ("set_warm_buffer", "m/1", None, GOOD)
    for bad, message in (({**GOOD, "min_replicas": 5}, "greater than max_replicas"),):
        with pytest.raises(queries.RegistryError, match=message), session_scope(db_url) as s:
            set_warm_buffer(s, "m", "1", **bad, actor="operator")
    with pytest.raises(queries.RegistryError, match="no version '9'"), session_scope(db_url) as s:
        set_warm_buffer(s, "m", "9", **GOOD, actor="operator")
    with session_scope(db_url) as s:
        assert get_warm_buffer(s, "m", "1").min_replicas == 1
        assert len(queries.list_audit(s, 10)) == 1
