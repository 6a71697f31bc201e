"""Registry schema, migrations and queries on SQLite and on the real PostgreSQL."""
import pytest
from sqlalchemy import inspect

from registry import queries
from registry.db import downgrade, get_engine, migrate, session_scope
from registry.schema import AuditLog


def test_migration_creates_every_table_and_downgrades(db_url):
    migrate(db_url)
    tables = set(inspect(get_engine(db_url)).get_table_names())
    assert {"models", "routes", "adapters", "teams", "callers", "warm_buffers", "audit_log", "replicas",
            "registry_meta"} <= tables
    downgrade(db_url, "base")
    assert "models" not in set(inspect(get_engine(db_url)).get_table_names())
    migrate(db_url)  # and up again


def test_routes_are_validated_audited_and_bump_the_version(db_url):
    migrate(db_url)
    with session_scope(db_url) as s:
        queries.upsert_model_version(s, "m", "1", status="serving")
        queries.upsert_model_version(s, "m", "2", status="staged")
        v0 = queries.registry_version(s)
        queries.set_routes(s, "m", {"1": 70, "2": 30}, actor="alice")
    with session_scope(db_url) as s:
        assert queries.routes_for(s, "m") == {"1": 70, "2": 30}
        assert queries.registry_version(s) > v0
        row = s.query(AuditLog).order_by(AuditLog.id.desc()).first()
        assert (row.actor, row.action, row.after) == ("alice", "set_routes", {"routes": {"1": 70, "2": 30}})
    with session_scope(db_url) as s:
        with pytest.raises(queries.RegistryError, match="sum to 90"):
            queries.set_routes(s, "m", {"1": 60, "2": 30}, actor="alice")
        with pytest.raises(queries.RegistryError, match="no version '9'.*known versions: \\['1', '2'\\]"):
            queries.set_routes(s, "m", {"9": 100}, actor="alice")
        queries.upsert_model_version(s, "m", "3", status="building")
        with pytest.raises(queries.RegistryError, match="'3' of 'm' is 'building'"):
            queries.set_routes(s, "m", {"1": 50, "3": 50}, actor="alice")
        with pytest.raises(queries.RegistryError, match="allowed 0..100"):
            queries.set_routes(s, "m", {"1": 130, "2": -30}, actor="alice")
    with session_scope(db_url) as s:  # refused writes changed nothing
        assert queries.routes_for(s, "m") == {"1": 70, "2": 30}


def test_api_keys_are_stored_hashed(db_url):
    migrate(db_url)
    with session_scope(db_url) as s:
        key = queries.create_caller(s, "svc", "search-team", max_tier="standard")
    with session_scope(db_url) as s:
        caller = queries.caller_by_key(s, key)
        assert caller is not None and caller.team == "search-team"
        assert key not in caller.api_key_hash and len(caller.api_key_hash) == 64
        assert queries.caller_by_key(s, key + "x") is None
        with pytest.raises(queries.RegistryError, match="max_tier 'gold'"):
            queries.create_caller(s, "svc2", "t", max_tier="gold")
