"""The model's output turned into OpenAI `tool_calls` (the formats router_service/tools.py asks for), whole
or as the stream deltas the SDKs accumulate: per call one delta with `index`, `id`, `type`, `function.name`
and empty arguments, then argument fragments with the same `index`.

`ToolPlan` says what a request's output is: `required` (a JSON array of calls), `named` (the arguments of
one function), `auto` (text that may be calls). Held text: in `auto` mode a reply whose first visible
character could start a call (`[`, `{`, `<`) is held back until the stream ends, then sent as calls or, if it
is not one, as content; anything else streams as content at once. A `named` call streams its argument
fragments as they are generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class ToolPlan:
    mode: str                    # "auto" | "required" | "named"
    names: list[str]
    named: str = ""


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _from_json(value, names: list[str]) -> list[dict] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(_call(item["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls or None


def parse(text: str, plan: ToolPlan) -> list[dict] | None:
    """The calls in `text`, or None when it is not (a complete) call."""
    if plan.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [_call(plan.named, text)]
    blocks = _HERMES.findall(text)
    try:
        if blocks and plan.mode == "auto":
            calls = [c for b in blocks for c in (_from_json(json.loads(b), plan.names) or [])]
            return calls if len(calls) == len(blocks) else None
        return _from_json(json.loads(text.strip()), plan.names)
    except ValueError:
        return None


def finish_reason(reason: str, calls: list[dict] | None) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class ToolStream:
    """One choice's streamed output: text deltas in, content or tool-call deltas out."""
    plan: ToolPlan
    held: str = ""
    holding: bool | None = None   # None: nothing visible seen yet
    named_id: str = ""
    emitted: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> dict | None:
        """The delta to send for `text` now (None: nothing yet)."""
        if self.plan.mode == "named":
            if not self.named_id:
                self.named_id = _call(self.plan.named, "")["id"]
                return {"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                        "function": {"name": self.plan.named, "arguments": text}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else None
        if self.plan.mode == "required":
            self.held += text
            return None
        if self.holding is None:
            self.held += text
            visible = self.held.lstrip()
            if not visible:
                return None
            self.holding = visible[0] in "[{<"
            if not self.holding:
                out, self.held = self.held, ""
                return {"content": out}
            return None
        if self.holding:
            self.held += text
            return None
        return {"content": text}

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """(the deltas still to send, the finish reason) once the stream has ended."""
        if self.plan.mode == "named":
            return [], "tool_calls" if reason == "stop" else reason
        if not self.held:
            return [], reason
        calls = parse(self.held, self.plan)
        if calls is None:
            held, self.held = self.held, ""
            return [{"content": held}], reason
        deltas = []
        for i, c in enumerate(calls):
            deltas.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                           "function": {"name": c["function"]["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
        return deltas, finish_reason(reason, calls)
