"""The SSE body of an `n` request from its choices' router streams: chunks carry their choice's index, the
usage comes once every choice has finished (prompt once, completions summed), a choice that fails ends the
response with an in-band error (never a hang), and every stream is closed."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from router_service.errors import RouterError
from router_service.openai_response import sse
from router_service.request import Finished, GenerateRequest, Prepared, TokenDelta


def _prepared(i: int) -> Prepared:
    req = GenerateRequest(request_id=f"req-x-{i}" if i else "req-x", model="m")
    return Prepared(req=req, caller=None, model=SimpleNamespace(name="m", version="1"), prompt_ids=[1, 2, 3])


class Source:
    """A choice's items, as the router's stream yields them (closed state recorded)."""

    def __init__(self, items: list, delay: float) -> None:
        self.items, self.delay, self.closed = items, delay, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(self.delay)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


def _finished(n: int) -> Finished:
    return Finished("stop", prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=n, model="m", version="1",
                    replica_id="r")


def _events(sources: list[Source], include_usage: bool) -> list:
    async def run():
        prepared = [_prepared(i) for i in range(len(sources))]
        return [e async for e in sse(None, sources, prepared, True, include_usage, None)]
    raw = asyncio.run(run())
    assert raw[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in raw[:-1]]


def test_n_choices_interleave_with_their_index_and_one_usage():
    sources = [Source([TokenDelta("a", [1]), TokenDelta("b", [2]), _finished(2)], 0.001),
               Source([TokenDelta("x", [3]), _finished(1)], 0.003)]
    events = _events(sources, include_usage=True)
    texts, roles = {0: "", 1: ""}, {0: 0, 1: 0}
    for e in events[:-1]:
        [c] = e["choices"]
        texts[c["index"]] += c["delta"].get("content", "")
        roles[c["index"]] += c["delta"].get("role") == "assistant"
    assert texts == {0: "ab", 1: "x"} and roles == {0: 1, 1: 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 3
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert all(s.closed for s in sources)


def test_a_failed_choice_ends_the_response_in_band():
    sources = [Source([TokenDelta("a", [1])] * 50 + [_finished(50)], 0.002),
               Source([TokenDelta("x", [3]), RouterError("unavailable", "replica gone")], 0.001)]
    events = _events(sources, include_usage=False)
    assert events[-1]["error"]["message"].endswith("replica gone")
    assert not any(c.get("finish_reason") for e in events[:-1] for c in e["choices"])
    assert all(s.closed for s in sources)
