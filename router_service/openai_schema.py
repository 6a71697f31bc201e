"""OpenAI-compatible request bodies (with the platform's extra fields) and their mapping to GenerateRequest."""
from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router_service.kserve_codec import deadline_from_param, tier_from_param
from router_service.request import MAX_CHAT_MESSAGES, GenerateRequest


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    # platform fields (pass with the openai client's `extra_body`)
    version: str | None = None
    adapter: str = ""
    priority: str | int | None = None
    deadline_ms: int | None = None
    session: str = ""
    cache_hint: str | None = None
    ignore_eos: bool = False  # generate max_tokens even past end-of-sequence (load tests, benchmarks)

    def to_request(self, **prompt) -> GenerateRequest:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerateRequest(
            request_id="req-" + uuid.uuid4().hex, model=self.model, version=self.version, adapter=self.adapter,
            tier=tier_from_param(self.priority),
            deadline_ms=deadline_from_param(self.deadline_ms) if self.deadline_ms is not None else None,
            max_tokens=next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None), 64),
            temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop, session=self.session or self.user or "",
            ignore_eos=self.ignore_eos, **prompt)


class CompletionBody(_Common):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("the prompt is empty")
        return v

    def request(self) -> GenerateRequest:
        if isinstance(self.prompt, list):
            return self.to_request(prompt_ids=list(self.prompt))
        return self.to_request(prompt_text=self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)

    def request(self) -> GenerateRequest:
        msgs = [{"role": m.role, "content": m.content} for m in self.messages]
        return self.to_request(chat_messages=msgs, prompt_text="\n".join(m["content"] for m in msgs))
