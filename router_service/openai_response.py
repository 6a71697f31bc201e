"""OpenAI response bodies from the router's streams: a whole (non-streamed) answer, or server-sent events,
for `n` choices (one router stream each), with logprobs and tool calls (router_service/tool_output.py).

Usage follows OpenAI: `prompt_tokens` once (the n choices share the prompt), `completion_tokens` the sum of
all choices. The usage events bill the same way: choices 2..n are metered with no prompt tokens
(GenerateRequest.bill_prompt).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from router_service.core import Router
from router_service.errors import RouterError
from router_service.request import Finished, Prepared, TokenDelta
from router_service.tool_output import ToolPlan, ToolStream, finish_reason, parse

_DONE = object()


def usage(finals: list[Finished]) -> dict:
    prompt = finals[0].prompt_tokens
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finals[0].cached_prompt_tokens}}


def logprobs(router: Router, p: Prepared, deltas: list[TokenDelta], chat: bool) -> dict | None:
    """OpenAI's logprobs object of these deltas (chat: `content` entries; completions: the legacy lists).
    Each token's text is the id decoded alone."""
    if not (p.req.logprobs or p.req.top_logprobs):
        return None
    tok = router.tokenizers.get(p.model.weights_uri)
    pairs = [(i, lp) for d in deltas for i, lp in zip(d.token_ids, d.logprobs or [])]

    def text(token_id: int) -> str:
        return tok.decode([token_id])
    if chat:
        def entry(t: int, lp: float) -> dict:
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in pairs]}
    offsets, at = [], 0
    for t, _ in pairs:
        offsets.append(at)
        at += len(text(t))
    return {"tokens": [text(t) for t, _ in pairs], "token_logprobs": [lp for _, (lp, _) in pairs],
            "top_logprobs": [{text(i): v for i, v in top} for _, (_, top) in pairs], "text_offset": offsets}


def choice(router: Router, index: int, p: Prepared, items: list, chat: bool, plan: ToolPlan | None) -> dict:
    """One choice of a non-streamed answer."""
    deltas = [i for i in items if isinstance(i, TokenDelta)]
    text = "".join(d.text for d in deltas)
    final = next(i for i in items if isinstance(i, Finished))
    lps = logprobs(router, p, deltas, chat)
    if not chat:
        return {"index": index, "text": text, "finish_reason": final.finish_reason, "logprobs": lps}
    calls = parse(text, plan) if plan is not None else None
    message = {"role": "assistant", "content": None, "tool_calls": calls} if calls else \
        {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish_reason(final.finish_reason, calls)}


async def _merge(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, item) of all sources as they arrive; one source is read directly."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, src: AsyncIterator) -> None:
        try:
            async for item in src:
                await queue.put((i, item))
        except Exception as exc:   # re-raised by the reader: a failed choice fails the response, never hangs it
            await queue.put((i, exc))
        await queue.put((i, _DONE))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        live = len(sources)
        while live:
            i, item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ChoiceStream:
    """One choice's SSE state: role sent yet, tool-call assembly."""

    def __init__(self, index: int, chat: bool, plan: ToolPlan | None) -> None:
        self.index, self.chat, self.first = index, chat, True
        self.tools = ToolStream(plan) if plan is not None and chat else None

    def _delta(self, delta: dict) -> dict:
        if self.first:
            self.first = False
            return {"role": "assistant", **delta}
        return delta

    def token(self, item: TokenDelta, lps: dict | None) -> list[dict]:
        if not self.chat:
            return [{"index": self.index, "text": item.text, "logprobs": lps, "finish_reason": None}]
        delta = self.tools.feed(item.text) if self.tools is not None else {"content": item.text}
        if delta is None and lps is None:
            return []
        return [{"index": self.index, "delta": self._delta(delta or {}), "logprobs": lps, "finish_reason": None}]

    def end(self, item: Finished) -> list[dict]:
        if not self.chat:
            return [{"index": self.index, "text": "", "logprobs": None, "finish_reason": item.finish_reason}]
        deltas, reason = self.tools.finish(item.finish_reason) if self.tools is not None else ([], item.finish_reason)
        out = [{"index": self.index, "delta": self._delta(d), "logprobs": None, "finish_reason": None} for d in deltas]
        return out + [{"index": self.index, "delta": self._delta({}) if self.first else {}, "logprobs": None,
                       "finish_reason": reason}]


async def sse(router: Router, sources: list[AsyncIterator], prepared: list[Prepared], chat: bool,
              include_usage: bool, plan: ToolPlan | None):
    """Server-sent events as OpenAI streams them. With `stream_options.include_usage` every chunk carries
    `usage: null` and one last chunk has `choices: []` and the usage; without it the chunk that finishes the
    last choice carries the usage (an extension the SDKs ignore). Usage is metered either way."""
    req = prepared[0].req
    base = {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": prepared[0].model.name,
            "system_fingerprint": prepared[0].model.version}
    if include_usage:
        base["usage"] = None
    states = [_ChoiceStream(i, chat, plan) for i in range(len(sources))]
    finals: list[Finished | None] = [None] * len(sources)
    try:
        async for i, item in _merge(sources):
            if isinstance(item, TokenDelta):
                lps = logprobs(router, prepared[i], [item], chat)
                for c in states[i].token(item, lps):
                    yield f"data: {json.dumps({**base, 'choices': [c]})}\n\n"
                continue
            finals[i] = item
            done = all(f is not None for f in finals)
            chunks = states[i].end(item)
            for k, c in enumerate(chunks):
                chunk = {**base, "choices": [c]}
                if done and not include_usage and k == len(chunks) - 1:
                    chunk["usage"] = usage(finals)
                yield f"data: {json.dumps(chunk)}\n\n"
            if done and include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(finals)})}\n\n"
    except RouterError as exc:  # after the stream started, errors travel in-band, in OpenAI's error shape
        yield f"data: {json.dumps(exc.openai())}\n\n"
    finally:
        for src in sources:
            await src.aclose()
    yield "data: [DONE]\n\n"
