"""What keeps one upstream stream honest: first-token and inter-token timeouts (a hung replica never
hangs its caller), the caller's deadline while waiting on a replica, and exact text across a resume.

Timeouts per tier are router settings (router_service/settings.py), as `interactive=15,standard=30,batch=60`
or one number for every tier:
- FLEET_ROUTER_FIRST_TOKEN_TIMEOUT_S: from the upstream call to its first token (prefill included);
- FLEET_ROUTER_INTER_TOKEN_TIMEOUT_S: between two responses of a stream;
- FLEET_ROUTER_STREAM_DEADLINE_S: the total time from a request's arrival at the router to its stream's end
  (admission queue wait, prefill, every token, resumes included; `TotalDeadline`). A request still queued then
  is refused with DEADLINE_EXCEEDED naming the deadline and its wait; a stream still running then ends in band
  with finish_reason `stream_deadline` (the tokens so far are delivered and billed); a caller's own earlier
  `deadline_ms` does the same with `deadline`. The longest deadline is also how long a stopping router lets its
  streams finish (`stop_grace_s`), and what a replica's drain and both pods' grace periods are sized from
  (deploy/, docs/kubernetes.md).
When one passes, the router judges the replica (docs/reliability.md, Slow is not dead): one whose state
reports show its engine stepping is slow, not dead (the stream keeps waiting, new work is held back); the
last serving replica of a model that stopped reporting is suspect, not cordoned (the stream keeps waiting
up to FLEET_ROUTER_RECOVER_WAIT_S while it is probed); any other replica that misses one is treated as dead
for this request: the router cordons it and resumes the stream elsewhere (see `Router.stream`).

Slow readers: a gRPC stream's responses wait in a queue of at most FLEET_ROUTER_STREAM_QUEUE (256)
responses; when it is full the request's upstream read pauses (backpressure down to the replica), and a
request whose responses wait longer than FLEET_ROUTER_SLOW_READER_TIMEOUT_S (30 s) for the caller to read
is stopped with an in-band RESOURCE_EXHAUSTED error, freeing its replica slot. HTTP streams get the same
backpressure from the server's transport flow control (the SSE generator pauses while the socket is full).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from common.text import IncrementalDetokenizer
from router_service.errors import RouterError
from router_service.request import TIERS, Finished, TokenDelta
from router_service.upstream import ReplicaFailed

DEFAULT_FIRST_TOKEN_S = {"interactive": 15.0, "standard": 30.0, "batch": 60.0}
DEFAULT_INTER_TOKEN_S = {"interactive": 10.0, "standard": 15.0, "batch": 30.0}
# the longest stream a replica serves: 4096 tokens at the slowest tier's 15 tokens/s is 273 s
DEFAULT_STREAM_DEADLINE_S = {"interactive": 300.0, "standard": 300.0, "batch": 300.0}


DEFAULT_STREAM_QUEUE = 256
DEFAULT_SLOW_READER_S = 30.0


def per_tier(raw: str, default: dict[str, float]) -> dict[str, float]:
    """'interactive=S,standard=S,batch=S' (tiers left out keep their default) or one number for all tiers."""
    raw, out = raw.strip(), dict(default)
    if not raw:
        return out
    try:
        if "=" not in raw:
            out = {tier: float(raw) for tier in TIERS}
        else:
            for part in raw.split(","):
                tier, value = (x.strip() for x in part.split("=", 1))
                if tier not in TIERS:
                    raise ValueError(f"unknown tier {tier!r}")
                out[tier] = float(value)
    except ValueError as exc:
        raise ValueError(f"{raw!r}: expected seconds or 'interactive=S,standard=S,batch=S' ({exc})") from None
    if any(not v > 0 for v in out.values()):
        raise ValueError(f"{raw!r}: timeouts must be positive")
    return out


@dataclass(frozen=True)
class StreamTimeouts:
    first_token_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FIRST_TOKEN_S))
    inter_token_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_INTER_TOKEN_S))
    queue_items: int = DEFAULT_STREAM_QUEUE       # gRPC stream responses waiting for a slow reader
    slow_reader_s: float = DEFAULT_SLOW_READER_S  # how long a response may wait for room in that queue
    stream_deadline_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_STREAM_DEADLINE_S))

    def stream_deadline_ms(self, tier: str, arrived_monotonic: float) -> int:
        """The wall-clock end (unix ms) of a stream of `tier` that arrived at `arrived_monotonic`."""
        elapsed = time.monotonic() - arrived_monotonic
        return int((time.time() - elapsed + self.stream_deadline_s[tier]) * 1000)

    def stop_grace_s(self) -> float:
        """How long a stopping router lets its open streams run: the longest total stream deadline."""
        return max(self.stream_deadline_s.values())

    def total_deadline(self, tier: str, arrived_monotonic: float, caller_deadline_ms: int | None) -> "TotalDeadline":
        """The earlier of the caller's `deadline_ms` and the tier's total stream deadline, both counted from
        the request's arrival at the router (monotonic `arrived_monotonic`)."""
        stream_end_ms = self.stream_deadline_ms(tier, arrived_monotonic)
        if caller_deadline_ms is not None and caller_deadline_ms <= stream_end_ms:
            return TotalDeadline(caller_deadline_ms, "deadline", tier, self.stream_deadline_s[tier], arrived_monotonic)
        return TotalDeadline(stream_end_ms, "stream_deadline", tier, self.stream_deadline_s[tier], arrived_monotonic)


@dataclass(frozen=True)
class TotalDeadline:
    """When a request's time at the router ends, and which deadline ends it: `deadline` (the caller's own
    deadline_ms) or `stream_deadline` (its tier's FLEET_ROUTER_STREAM_DEADLINE_S from arrival)."""
    end_ms: int
    reason: str
    tier: str
    tier_s: float
    arrived: float  # monotonic

    def passed(self) -> bool:
        return self.end_ms <= time.time() * 1000

    def what(self) -> str:
        if self.reason == "deadline":
            return "the caller's deadline_ms"
        return f"the total stream deadline of tier {self.tier!r} ({self.tier_s:g} s from arrival at the router)"

    def queued_error(self, queue: str, waited_s: float) -> RouterError:
        """DEADLINE_EXCEEDED for a request whose deadline passed while it waited for a replica slot."""
        return RouterError("deadline_exceeded",
                           f"{self.what()} passed after {waited_s:.2f} s in the admission queue of {queue} "
                           f"({time.monotonic() - self.arrived:.2f} s after the request arrived); nothing was "
                           f"generated", param="deadline_ms" if self.reason == "deadline" else None)


class DeadlineReached(Exception):
    """The caller's deadline passed while the router waited on the replica."""


class ReplicaHung(ReplicaFailed):
    """The replica sent nothing within the first-token or inter-token timeout: treated as dead."""


# judge(got_token, waited_s, limit_s) -> True to keep waiting: asked each time a timeout passes (see Router._judge)
Judge = Callable[[bool, float, float], bool]


async def guarded(items: AsyncIterator, first_s: float, inter_s: float, deadline_ms: int | None,
                  judge: Judge | None = None) -> AsyncIterator[TokenDelta | Finished]:
    """Re-yield `items`, waiting at most first_s for the first token and inter_s between responses, and
    never past the caller's deadline. Time the consumer spends between items is not counted.

    When a timeout passes, `judge` decides whether the replica is slow (it reports engine progress) or may
    come back (the last replica of its model), and the wait goes on for another period on the same upstream
    call, so the tokens a slow or resumed replica sends are not lost; otherwise ReplicaHung. To wait on the
    call without cancelling it, a pump task reads it, one response ahead at most (the replica's stream keeps
    its flow control)."""
    pump = _Pump(items)
    got_token = False
    try:
        while True:
            limit = inter_s if got_token else first_s
            waited = 0.0
            while not pump.ready:
                left = None if deadline_ms is None else deadline_ms / 1000 - time.time()
                wait = limit if left is None else max(0.0, min(limit, left))
                if await pump.wait(wait):
                    break
                if left is not None and left <= limit:
                    raise DeadlineReached()
                waited += wait
                if judge is None or not judge(got_token, waited, limit):
                    what = "inter-token" if got_token else "first-token"
                    raise ReplicaHung(f"no response within the {what} timeout of {limit:g} s"
                                      + (f" (waited {waited:g} s)" if waited > limit else ""))
            item = pump.take()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            got_token = got_token or isinstance(item, TokenDelta)
            yield item
    finally:
        await pump.close()
        await items.aclose()


_END = object()


class _Pump:
    """Reads an async iterator in its own task, one item ahead of the consumer, so the consumer can stop
    waiting (a timeout) without cancelling the read."""

    def __init__(self, items: AsyncIterator) -> None:
        self.items = items
        self.buf: deque = deque()
        self.loop = asyncio.get_running_loop()
        self.waiter: asyncio.Future | None = None
        self.space: asyncio.Future | None = None
        self.task = self.loop.create_task(self._run())

    @property
    def ready(self) -> bool:
        return bool(self.buf)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def _run(self) -> None:
        try:
            async for item in self.items:
                self.buf.append(item)
                self._wake()
                while self.buf:  # wait until the consumer took it
                    self.space = self.loop.create_future()
                    await self.space
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer, raised there)
            self.buf.append(exc)
        else:
            self.buf.append(_END)
        self._wake()

    async def wait(self, seconds: float) -> bool:
        """True once an item (or the end) is ready, False after `seconds` without one."""
        waiter = self.waiter = self.loop.create_future()
        timer = self.loop.call_later(seconds, self._wake)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        return bool(self.buf)

    def take(self) -> object:
        item = self.buf.popleft()
        if self.space is not None and not self.space.done():
            self.space.set_result(None)
        return item

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


class StreamText:
    """The text a stream's caller receives. By default the replica's (its ensemble detokenizes); the router
    decodes it itself from the ids (`decode_from`) when the replica streams ids only (a CPU replica's engine
    called directly) and from a stream's first resume on: a replica holds back the bytes of an unfinished
    multi-byte character until its next token; if it dies then, a new replica (whose detokenizer starts at the
    resume point) would turn the rest of that character into U+FFFD, so after a resume the router decodes the
    text from *all* the ids of the stream and ignores the replicas' text."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.detok: IncrementalDetokenizer | None = None
        self.skip = 0       # chars the router's decoder has yet to produce that the caller already has
        self.carry = ""     # text the router's decoder produced that the caller does not have yet

    @property
    def decoding(self) -> bool:
        """Whether the router decodes this stream's text itself (from now on)."""
        return self.detok is not None

    def decode_from(self, tokenizer, emitted: list[int]) -> None:
        """Decode the text here from now on; `emitted` = the ids the caller has had text for so far."""
        if self.detok is not None:
            return  # already decoding ourselves: the state carries on
        self.detok = IncrementalDetokenizer(getattr(tokenizer, "backend_tokenizer", tokenizer))
        produced = self.detok.add(list(emitted))
        self.skip = max(0, self.sent_chars - len(produced))
        self.carry = produced[self.sent_chars:]

    def _take(self, text: str) -> str:
        if self.skip:
            drop = min(self.skip, len(text))
            text, self.skip = text[drop:], self.skip - drop
        text, self.carry = self.carry + text, ""
        self.sent_chars += len(text)
        return text

    def delta(self, item: TokenDelta) -> TokenDelta:
        if self.detok is None:
            self.sent_chars += len(item.text)
            return item
        return TokenDelta(self._take(self.detok.add(item.token_ids)), item.token_ids, item.logprobs)

    def tail(self) -> str:
        """At the end of the stream: whatever the router's decoder still holds back."""
        return "" if self.detok is None else self._take(self.detok.flush())
