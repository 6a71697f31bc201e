"""Alembic environment: the URL comes from the caller's config (registry.db.migrate) or FLEET_DB_URL."""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from common.settings import load_settings
from registry.schema import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or load_settings().db_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
