"""OpenAI-compatible request bodies (with the platform's extra fields) and their mapping to GenerateRequest.

OpenAI semantics kept here: an explicit JSON `null` means the field is absent (the SDKs send them), chat
content may be a string or an array of text parts, `developer` is the newer name of `system`, and an
absent `max_tokens` means the rest of the context (resolved in GenerateRequest.check_prompt_fits). Fields
the platform does not implement are refused with a 400 naming the field and what is allowed, never
silently ignored; docs/api.md lists every field. Tools: router_service/tools.py (definitions, rendering,
the forced-call grammar) and tool_output.py (the output as `tool_calls`).
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.sampling_fields import spec_problem
from router_service.errors import invalid
from router_service.kserve_codec import deadline_from_param, tier_from_param
from router_service.request import MAX_CHAT_MESSAGES, MAX_N, MAX_SESSION_CHARS, GenerateRequest
from router_service.tool_output import ToolPlan
from router_service.tools import (MAX_TOOL_CALL_ID_CHARS, MAX_TOOLS, NamedToolChoice, ToolCall, ToolChoice, ToolDef,
                                  check_tools, forced_spec)

MAX_CONTENT_PARTS = 256


def _drop_nulls(data: Any) -> Any:
    """`{"temperature": null}` is `{}`: OpenAI's API and its SDKs treat an explicit null as not set."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False   # one more chunk before [DONE]: `choices: []` and the usage

    _nulls = model_validator(mode="before")(classmethod(lambda cls, d: _drop_nulls(d)))


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format, plus `regex` (a platform extension: {"type": "regex", "pattern": ...})."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchemaFormat | None = None
    pattern: str | None = None

    def guided(self) -> dict | None:
        """The engine's structured-output spec (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            if self.json_schema is None:
                raise invalid("response_format.json_schema", "is required with type json_schema")
            return {"type": "json_schema", "schema": self.json_schema.schema_,
                    "strict": self.json_schema.strict is not False}
        if self.pattern is None:
            raise invalid("response_format.pattern", "is required with type regex")
        return {"type": "regex", "pattern": self.pattern}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _nulls = model_validator(mode="before")(classmethod(lambda cls, d: _drop_nulls(d)))

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = Field(None, max_length=MAX_SESSION_CHARS)  # the rollout stickiness key when no session
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's names for the sampling fields OpenAI lacks (pass with `extra_body`)
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    # platform fields (pass with the openai client's `extra_body`)
    version: str | None = None
    adapter: str = ""
    priority: str | int | None = None
    deadline_ms: int | None = None
    session: str = ""
    ignore_eos: bool = False  # generate max_tokens even past end-of-sequence (load tests, benchmarks)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """Fields the SDKs send whose non-default values this platform does not implement: a clear 400."""
        if not 1 <= self.n <= MAX_N:
            raise invalid("n", f"must be between 1 and {MAX_N}, got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "is only allowed with stream: true")

    def logprob_fields(self) -> tuple[bool, int]:
        """(logprobs, top_logprobs) as this endpoint spells them."""
        raise NotImplementedError

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.lstrip("-").isdigit() and len(key) < 12):
                raise invalid("logit_bias", f"key {key[:32]!r} is not a token id")
            out[int(key)] = bias
        return out

    def to_request(self, **prompt) -> GenerateRequest:
        self.refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, top_logprobs = self.logprob_fields()
        return GenerateRequest(
            logprobs=logprobs, top_logprobs=top_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self._logit_bias(), min_p=self.min_p, min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            guided=self.response_format.guided() if self.response_format is not None else None,
            request_id="req-" + uuid.uuid4().hex, model=self.model, version=self.version, adapter=self.adapter,
            tier=tier_from_param(self.priority),
            deadline_ms=deadline_from_param(self.deadline_ms) if self.deadline_ms is not None else None,
            max_tokens=next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None), None),
            temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop, session=self.session or self.user or "",
            ignore_eos=self.ignore_eos, **prompt)


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None   # legacy completions: the number of top tokens (0 = the sampled one only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("the prompt is empty")
        return v

    def logprob_fields(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def tool_plan(self) -> None:
        return None

    def request(self) -> GenerateRequest:
        if self.echo:
            raise invalid("echo", "is not supported; send false or leave it out")
        if self.suffix:
            raise invalid("suffix", "is not supported (no fill-in-the-middle); leave it out")
        if self.best_of not in (None, 1):
            raise invalid("best_of", f"only 1 is supported, got {self.best_of}")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise invalid("prompt", f"a list of {len(prompt)} prompts; one prompt per request is supported")
            prompt = prompt[0]
            if not prompt.strip():
                raise invalid("prompt", "the prompt is empty")
        if isinstance(prompt, list):
            return self.to_request(prompt_ids=list(prompt))
        return self.to_request(prompt_text=prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _nulls = model_validator(mode="before")(classmethod(lambda cls, d: _drop_nulls(d)))

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] = Field("", max_length=MAX_CONTENT_PARTS)
    name: str | None = Field(None, max_length=64)   # OpenAI's own bound
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)   # assistant turns that called tools
    tool_call_id: str | None = Field(None, max_length=MAX_TOOL_CALL_ID_CHARS)   # a tool turn: which call it answers

    @model_validator(mode="after")
    def _tool_fields(self):
        if "content" not in self.model_fields_set and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: is required (only an assistant message with tool_calls may leave it out)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages carry tool_call_id")
        return self

    def text(self) -> str:
        """Text parts are joined with a newline (as vLLM does)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def for_template(self) -> dict:
        # `developer` is OpenAI's newer name of `system`; chat templates know `system`
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def logprob_fields(self) -> tuple[bool, int]:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        return self.logprobs, self.top_logprobs or 0

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        if v in ("none", "auto", "required") or isinstance(v, NamedToolChoice):
            return v
        if isinstance(v, dict):
            return NamedToolChoice.model_validate(v)
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")

    def tool_plan(self) -> ToolPlan | None:
        """How the output is read (router_service/tool_output.py): None = plain content."""
        if not self.tools or self.tool_choice == "none":
            return None
        names = [t.function.name for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolPlan("named", names, self.tool_choice.function.name)
        return ToolPlan(self.tool_choice or "auto", names)

    def request(self) -> GenerateRequest:
        tools = self.tools or []
        check_tools(tools, self.tool_choice)
        forced = forced_spec(tools, self.tool_choice, self.parallel_tool_calls)
        if forced is not None and self.response_format is not None and self.response_format.type != "text":
            raise invalid("response_format", "cannot be combined with tool_choice 'required' or a named function "
                                             "(the call's arguments are already constrained)")
        problem = spec_problem(forced) if forced is not None else ""
        if problem:   # the forced call's grammar is the tools' schemas: name them, not response_format
            raise invalid("tools", problem.split(": ", 1)[1])
        msgs = [m.for_template() for m in self.messages]
        req = self.to_request(chat_messages=msgs, prompt_text="\n".join(m["content"] for m in msgs))
        if tools and self.tool_choice != "none":
            req.tools = [t.model_dump(exclude_none=True) for t in tools]
        if forced is not None:
            req.guided = forced
        return req
