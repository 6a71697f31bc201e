"""Tool calling (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): the request's tool definitions and
history messages, how they are rendered into the prompt, and the grammar that constrains a forced call.

Rendering: the model's own chat template gets `tools=` (transformers' `apply_chat_template`) when its
source reads a `tools` variable; otherwise (SmolLM2's template, for one) the fallback below writes the tools
into the system message (FALLBACK_PROMPT), an assistant turn's `tool_calls` as the JSON the model is asked to
write, and a `tool` message as a user turn `<tool_response>...</tool_response>` (templates that know only
system/user/assistant accept it). `tool_choice: "none"` renders no tools at all.

What the model writes (router_service/tool_output.py parses it):
- `required`: a JSON array of calls `[{"name": ..., "arguments": {...}}]`, enforced by a JSON schema whose
  items are one `anyOf` branch per function (the name a `const`, the arguments the function's schema);
  `parallel_tool_calls: false` caps it at one call.
- a named function: the arguments object alone, enforced by that function's schema.
- `auto`: free text; a reply that is such a JSON array or object, or `<tool_call>{...}</tool_call>` blocks
  (the Hermes format many templates teach), becomes `tool_calls`.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.sampling_fields import MAX_SPEC_BYTES
from router_service.errors import invalid

MAX_TOOLS = 64
MAX_PARALLEL_CALLS = 8        # items of a forced call array (a small model may otherwise repeat calls)
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOL_CALL_ID_CHARS = 128
FALLBACK_PROMPT = ("You can call functions. They are listed below, one JSON object per line:\n<tools>\n{tools}\n"
                   "</tools>\nTo call functions, reply with only a JSON array of calls, "
                   '[{{"name": <function name>, "arguments": <arguments object>}}], and nothing else.')


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(None, max_length=4096)
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str = Field(max_length=MAX_SPEC_BYTES)   # a JSON object as text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tools(tools: list[ToolDef], choice: ToolChoice | None) -> None:
    """Bounds the pydantic models cannot state: count, size, unique names, a named choice among them."""
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))
    if size > MAX_SPEC_BYTES:
        raise invalid("tools", f"the tool definitions are {size} bytes as JSON; at most {MAX_SPEC_BYTES}")
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid("tools", f"function name {dup!r} appears more than once")
    for i, t in enumerate(tools):
        if t.function.parameters.get("type", "object") != "object":
            raise invalid(f"tools.{i}.function.parameters", "must be a JSON schema of type object")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid("tool_choice", f"function {choice.function.name!r} is not one of tools ({', '.join(names)})")
    if choice not in (None, "none", "auto") and not tools:
        raise invalid("tool_choice", "needs tools")


def forced_spec(tools: list[ToolDef], choice: ToolChoice | None, parallel: bool) -> dict | None:
    """The structured-output spec that forces a call (`required` or a named function), else None."""
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return {"type": "json_schema", "schema": fn.parameters, "strict": True}
    if choice != "required":
        return None
    branches = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                  "arguments": t.function.parameters},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "json_schema", "strict": True,
            "schema": {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                       "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}}


def _call_text(calls: list[dict]) -> str:
    return json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                       for c in calls])


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def supports_tools(tok) -> bool:
    """Whether the model's chat template renders `tools` itself (its source reads the variable)."""
    return "tools" in (getattr(tok, "chat_template", None) or "")


def for_template(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The messages (and tools) to hand to the chat template. `messages` are the request's, each with a
    string `content` and optionally `tool_calls` (assistant) or `tool_call_id` (tool)."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):   # templates index arguments as a mapping (transformers' convention)
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, tools
    out = []
    for m in messages:
        if m.get("tool_calls"):
            text = (m["content"] + "\n" if m["content"] else "") + _call_text(m["tool_calls"])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
