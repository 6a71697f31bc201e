"""The usage event: one per finished, failed or cancelled request, topic `llm.usage.v1`
(docs/architecture.md, Usage events).

The router builds it; the producer spools and sends it (key = caller); the loader validates it
against this same model and lands it in the columnar store.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Priority = Literal["interactive", "standard", "batch"]
FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]


class UsageEvent(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1)
    ts: float = Field(description="completion time, unix seconds")
    caller: str = Field(min_length=1)
    team: str = Field(min_length=1)
    model: str = Field(min_length=1)
    version: str = Field(min_length=1)
    adapter: str = ""
    priority: Priority = "standard"
    region: str = "local"
    replica_id: str = ""
    prompt_tokens: int = Field(ge=0)
    cached_prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    ttft_ms: float = Field(ge=0)
    duration_ms: float = Field(ge=0)
    finish_reason: FinishReason
    status: Literal["ok", "error", "cancelled"] = "ok"
    # The request's W3C trace id (32 lower-case hex digits; the caller's when it sent a traceparent), so a
    # usage row joins to its trace; None when the request had none (events from routers before this field).
    trace_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")

    def key(self) -> bytes:
        return self.caller.encode()

    def to_json_bytes(self) -> bytes:
        return self.model_dump_json().encode()
