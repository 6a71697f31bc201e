"""Fixtures for the usage tests: unique topics per test on the session broker, an event factory."""
from __future__ import annotations

import time
import uuid

import pytest

from usage.events import UsageEvent


@pytest.fixture
def topic() -> str:
    return f"usage-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_event():
    def make(request_id: str | None = None, **kw) -> UsageEvent:
        fields = dict(request_id=request_id or uuid.uuid4().hex, ts=time.time(), caller="alice", team="search",
                      model="smollm2-135m", version="1", prompt_tokens=100, cached_prompt_tokens=40,
                      completion_tokens=20, ttft_ms=12.5, duration_ms=300.0, finish_reason="stop")
        fields.update(kw)
        return UsageEvent(**fields)
    return make
