"""The loader's known-caller set from the real registry (SQLite via the Alembic migration)."""
from __future__ import annotations

from registry.db import migrate, session_scope
from registry.queries import create_caller
from usage.loader import UsageLoader, registry_callers


def test_registry_callers(sqlite_url):
    migrate(sqlite_url)
    with session_scope(sqlite_url) as session:
        create_caller(session, "alice", "search")
        create_caller(session, "bob", "ads")
    assert registry_callers(sqlite_url)() == {"alice", "bob"}


def test_unreachable_registry_disables_the_check_instead_of_rejecting_everything(tmp_path):
    def broken() -> set[str]:
        raise ConnectionError("registry down")
    loader = UsageLoader("127.0.0.1:1", tmp_path / "u.duckdb", known_callers=broken)
    assert loader._caller_set() is None
