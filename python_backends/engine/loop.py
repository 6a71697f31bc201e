"""EngineLoop: the background thread that drives LLMEngine and hands each output to its request's sink.

Callers (Triton's `execute`, tests, benchmarks) only enqueue: `submit` puts the request in an inbox and
returns at once. The loop thread drains the inbox, polls the sinks for cancellation (a cancelled request is
aborted and its blocks freed in the same iteration), runs one engine step and delivers its outputs.
Everything that touches engine state runs on this one thread, so the engine needs no locks; other threads
(the state reporter) only read the snapshots this thread publishes via `on_tick`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from python_backends.engine.engine import LLMEngine, StepOutput
from python_backends.engine.sequence import FinishReason, SamplingParams, Sequence

log = logging.getLogger(__name__)


class Sink(Protocol):
    def send(self, output: StepOutput) -> None: ...
    def is_cancelled(self) -> bool: ...


class CallbackSink:
    """A sink from plain callables (tests, benchmarks)."""

    def __init__(self, send: Callable[[StepOutput], None], is_cancelled: Callable[[], bool] = lambda: False):
        self._send, self._cancelled = send, is_cancelled

    def send(self, output: StepOutput) -> None:
        self._send(output)

    def is_cancelled(self) -> bool:
        return self._cancelled()


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_tick: Callable[[LLMEngine], None] | None = None,
                 tick_s: float = 0.2, cancel_poll_s: float = 0.1):
        self.engine = engine
        self.on_tick = on_tick
        self.tick_s, self.cancel_poll_s = tick_s, cancel_poll_s
        self._inbox: list[tuple] = []
        self._cv = threading.Condition()
        self._stop = False
        self._sinks: dict[int, tuple[Sequence, Sink]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, priority: int = 1,
               deadline_ms: int = 0, lora_name: str = "", request_id: object = None) -> None:
        with self._cv:
            self._inbox.append(("add", (prompt_ids, params, priority, deadline_ms, lora_name, request_id), sink))
            self._cv.notify()

    def abort(self, request_id: object) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id, None))
            self._cv.notify()

    def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run fn(engine) on the loop thread and return its result (for consistent reads in tests)."""
        done = threading.Event()
        box: list = []
        with self._cv:
            self._inbox.append(("call", (fn, box, done), None))
            self._cv.notify()
        done.wait(60)
        return box[0] if box else None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        last_poll = last_tick = 0.0
        while True:
            with self._cv:
                if self._stop:
                    break
                if not self._inbox and not self.engine.has_work():
                    self._cv.wait(timeout=self.tick_s)
                inbox, self._inbox = self._inbox, []
            try:
                for kind, payload, sink in inbox:
                    self._handle(kind, payload, sink)
                now = time.monotonic()
                if self._sinks and now - last_poll >= self.cancel_poll_s:
                    last_poll = now
                    self._poll_cancellations()
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                    if self.engine.last_scheduled == 0:
                        time.sleep(0.005)   # work exists but none could run (e.g. adapter slots pinned)
                if self.on_tick and now - last_tick >= self.tick_s:
                    last_tick = now
                    self.on_tick(self.engine)
            except Exception as exc:   # never let the loop die silently: fail in-flight requests, keep serving
                log.exception("engine step failed")
                self.error = exc
                self._fail_all()
        self._fail_all(FinishReason.CANCELLED)

    def _handle(self, kind: str, payload: object, sink: Sink | None) -> None:
        if kind == "add":
            prompt_ids, params, priority, deadline_ms, lora_name, request_id = payload
            seq = self.engine.add_request(prompt_ids, params, priority, deadline_ms, lora_name, request_id)
            self._sinks[seq.seq_id] = (seq, sink)
        elif kind == "abort":
            for seq, _ in list(self._sinks.values()):
                if seq.request_id == payload:
                    self.engine.abort(seq)
        elif kind == "call":
            fn, box, done = payload
            try:
                box.append(fn(self.engine))
            finally:
                done.set()

    def _poll_cancellations(self) -> None:
        for seq, sink in list(self._sinks.values()):
            try:
                cancelled = sink.is_cancelled()
            except Exception:
                cancelled = True
            if cancelled:
                self.engine.abort(seq)   # its final response goes out with the next step's outputs

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            entry = self._sinks.get(out.seq.seq_id)
            if entry is None:
                continue
            if out.finished:
                del self._sinks[out.seq.seq_id]
            try:
                entry[1].send(out)
            except Exception:
                log.exception("sending a response failed; aborting sequence %s", out.seq.seq_id)
                if not out.finished:
                    self.engine.abort(out.seq)

    def _fail_all(self, reason: FinishReason = FinishReason.ERROR) -> None:
        for seq, _ in list(self._sinks.values()):
            self.engine.abort(seq, reason)
        self._deliver(self.engine.take_pending())
