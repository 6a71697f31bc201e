"""Registry connection: engine/session factory and `alembic upgrade head` run from code."""
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from common.settings import REPO_ROOT

_engines: dict[str, Engine] = {}


def get_engine(db_url: str) -> Engine:
    if db_url not in _engines:
        if db_url.startswith("sqlite:///"):
            Path(db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(db_url, connect_args={"timeout": 30})

            @event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn, _record):  # several processes share the file
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()
        else:
            engine = create_engine(db_url, pool_pre_ping=True)
        _engines[db_url] = engine
    return _engines[db_url]


@contextmanager
def session_scope(db_url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    session = sessionmaker(get_engine(db_url), expire_on_commit=False)()
    try:
        yield session
        session.commit()
    except Exception:
        session.rollback()
        raise
    finally:
        session.close()


def alembic_config(db_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(REPO_ROOT / "alembic"))
    cfg.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return cfg


def migrate(db_url: str, revision: str = "head") -> None:
    if db_url.startswith("sqlite:///"):
        Path(db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(db_url), revision)


def downgrade(db_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(db_url), revision)
