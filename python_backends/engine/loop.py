"""EngineLoop: the background thread that drives LLMEngine and hands each output to its request's sink.

The loop thread also builds the engine (`EngineLoop(build)`), so every torch op of the engine runs on this one
thread. Each thread that runs a parallel torch op gets an OpenMP worker pool of its own; with a second pool
(the thread that loaded the weights) libgomp counts more threads than cores and its workers sleep after ~1k
spins instead of 300k, so each of a step's ~1,800 parallel ops waits for a futex wake-up. Measured in-process,
2 cores, 32 streams: built on another thread 170.6 ms per step, on the stepping thread 139.7 ms (an Ice
Lake-class Xeon; 45.5 vs 31.5-36.8 ms on a Zen 4 EPYC). Spinning workers are right for a replica that owns its
cores and wrong for replicas that share them (two such replicas on two cores: 586 ms per step each, against
200-210 ms with short spins); the fleet setting `replica_cpu_cores` (shared, or auto with another replica on
the host) makes libgomp's spin short (GOMP_SPINCOUNT) for a replica it starts, see docs/engine.md.

Callers (Triton's `execute`, tests, benchmarks) only enqueue: `submit` puts the request in an inbox and
returns at once. The loop thread drains the inbox, polls the sinks for cancellation (a cancelled request is
aborted and its blocks freed in the same iteration), runs one engine step and hands its outputs, through the
StreamCoalescer (under load, a stream's tokens a few at a time), to the Courier, whose thread sends them (in
order) while the next step runs. Everything that touches engine state runs on the loop thread, so the engine
needs no locks; other threads (the courier, the state reporter) only post to the inbox or read the snapshots
this thread publishes via `on_tick`.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from python_backends.engine.engine import LLMEngine, StepOutput
from python_backends.engine.sequence import FinishReason, SamplingParams, Sequence
from python_backends.engine.stream_coalescer import StreamCoalescer

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


class Courier:
    """Hands outputs to their sinks on a thread of its own, in order. A Triton response costs ~0.6 ms of IPC;
    32 streams' responses sent from the loop thread added ~20 ms to every step, while from here they overlap
    the next step's forward (torch releases the GIL). A send that fails is reported through `on_failure`."""

    def __init__(self, on_failure: Callable[[StepOutput], None]):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="engine-courier", daemon=True)

    def start(self) -> "Courier":
        self._thread.start()
        return self

    def put(self, parcels: list[tuple[Sink, StepOutput]]) -> None:
        if parcels:
            self._queue.put(parcels)

    def stop(self, timeout: float = 10.0) -> None:
        """Deliver what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (parcels := self._queue.get()) is not None:
            for sink, out in parcels:
                try:
                    sink.send(out)
                except Exception:
                    log.exception("sending a response failed (sequence %s)", out.seq.seq_id)
                    if not out.finished:
                        self._on_failure(out)


class EngineLoop:
    def __init__(self, build: Callable[[], LLMEngine], on_tick: Callable[[LLMEngine], None] | None = None,
                 tick_s: float = 0.2, cancel_poll_s: float = 0.1):
        self._build = build
        self.engine: LLMEngine | None = None          # set by start(), built on the loop thread
        self._built = threading.Event()
        self.on_tick = on_tick
        self.tick_s, self.cancel_poll_s = tick_s, cancel_poll_s
        self._inbox: list[tuple] = []
        self._cv = threading.Condition()
        self._stop = False
        self._sinks: dict[int, tuple[Sequence, Sink]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._courier = Courier(on_failure=lambda out: self._post("abort_seq", out.seq))
        self._coalescer: StreamCoalescer | None = None   # from the engine's config, once built
        self.error: BaseException | None = None

    def start(self, timeout: float = 600.0) -> "EngineLoop":
        """Start the thread and wait until it has built the engine; a build error is raised here."""
        self._courier.start()
        self._thread.start()
        if not self._built.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout:.0f} s")
        if self.engine is None:
            self._courier.stop()
            raise self.error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        self._courier.stop(timeout)

    def _post(self, kind: str, payload: object, sink: Sink | None = None) -> None:
        with self._cv:
            self._inbox.append((kind, payload, sink))
            self._cv.notify()

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, priority: int = 1,
               deadline_ms: int = 0, lora_name: str = "", request_id: object = None) -> None:
        self._post("add", (prompt_ids, params, priority, deadline_ms, lora_name, request_id), sink)

    def abort(self, request_id: object) -> None:
        self._post("abort", request_id)

    def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run fn(engine) on the loop thread and return its result (for consistent reads in tests)."""
        done = threading.Event()
        box: list = []
        self._post("call", (fn, box, done))
        done.wait(60)
        return box[0] if box else None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            self.engine = self._build()
            config = self.engine.config
            self._coalescer = StreamCoalescer(config.stream_interval, config.stream_interval_min_rows,
                                              config.stream_interval_max)
        except BaseException as exc:
            self.error, self.engine = exc, None
            return
        finally:
            self._built.set()
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
                    if self.engine.config.test_step_sleep_s:  # tests: a slow step (the state report still goes out)
                        time.sleep(self.engine.config.test_step_sleep_s)
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
        elif kind == "abort_seq":           # its response could not be sent (Courier)
            if payload.seq_id in self._sinks:
                self.engine.abort(payload)
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
        parcels = []
        for out in self._coalescer.release(outputs):
            entry = self._sinks.get(out.seq.seq_id)
            if entry is None:
                continue
            if out.finished:
                del self._sinks[out.seq.seq_id]
            parcels.append((entry[1], out))
        self._courier.put(parcels)

    def _fail_all(self, reason: FinishReason = FinishReason.ERROR) -> None:
        for seq, _ in list(self._sinks.values()):
            self.engine.abort(seq, reason)
        self._deliver(self.engine.take_pending())
