"""Shared registry seeding for the router tests: a migrated registry with model `m` routed 100 % to
version 1, and optionally replicas (no replica processes: admission and choice only reserve slots)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import pytest
from sqlalchemy.orm import Session

from registry import queries
from registry.db import migrate, session_scope
from tests.admin_ui.gate_reports import gate_report

MODEL = "m"


def seed_registry(db_url: str, versions: Iterable[str] = ("1",), replicas: Iterable[tuple[str, str]] = (),
                  extra: Callable[[Session], None] | None = None, weights_uri: str = "") -> None:
    """Migrate, add `m`'s versions (serving, context 2048, a passed quality gate) routed 100 % to the first, add
    replicas (id, region) of version 1, then run `extra(session)` for what a test needs beyond that."""
    migrate(db_url)
    versions = list(versions)
    with session_scope(db_url) as s:
        for v in versions:
            queries.upsert_model_version(s, MODEL, v, status="serving", max_context=2048, weights_uri=weights_uri,
                                         quality_gate=gate_report(0.97))
        queries.set_routes(s, MODEL, {versions[0]: 100}, actor="seed")
        for replica_id, region in replicas:
            queries.upsert_replica(s, replica_id, model=MODEL, version=versions[0], region=region,
                                   grpc_url="127.0.0.1:1", http_url="http://x", state="serving")
        if extra is not None:
            extra(s)
        queries.bump_version(s)


@pytest.fixture
def seeded(smollm2_dir) -> Callable[..., None]:
    """`seed_registry` with the real SmolLM2 tokenizer as the model's weights (the router checks prompts and
    token ids against its vocabulary), for tests that seed their own database URL."""
    return functools.partial(seed_registry, weights_uri=str(smollm2_dir))
