"""Warm before ready: the engine runs one burst shaped like real traffic before Triton reports the model ready.

A replica's first burst used to be much slower than its second (measured after `make up` on a 2-core EPYC:
32 streams at 82 tok/s, TTFT p95 14.0 s; the next burst 109 tok/s, 3.7 s): the first steps of each shape pay
for first-touch of the KV pool's pages, oneDNN/kernel selection per batch size and Python-side caches. An
autoscaled replica takes its share of traffic at once, so the triton shim (model_repository/engine) calls
`warm_up` at the end of `initialize`: Triton marks the model ready, and the router's and the kubelet's readiness
checks pass, only after it returned. The burst: `warmup_seqs` sequences (config, default 16; 0 = off) of
distinct random prompts long enough to take several chunked-prefill steps together, then a few decode steps at
the full batch size, greedy, EOS ignored. Its prompts are random ids, so the prefix cache keeps nothing a real
prompt can match (their blocks are the first the pool evicts). On GPU (TensorRT-LLM) the same is Triton's
`model_warmup` in model_repository/gpu/llm/config.pbtxt.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from python_backends.engine.engine import StepOutput
from python_backends.engine.loop import CallbackSink, EngineLoop
from python_backends.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupReport:
    sequences: int
    prompt_tokens: int  # per sequence
    new_tokens: int     # per sequence
    seconds: float


def warm_up(loop: EngineLoop, sequences: int, prompt_tokens: int = 64, new_tokens: int = 4,
            timeout_s: float = 600.0) -> WarmupReport | None:
    """Run the warm-up burst on `loop` and wait for it (None when `sequences` is 0). Raises TimeoutError when
    it does not finish in `timeout_s`: a replica that cannot run 16 short sequences should not report ready."""
    if sequences <= 0:
        return None
    config = loop.call(lambda engine: engine.config)
    vocab = int(loop.call(lambda engine: engine.runner.vocab))
    sequences = min(sequences, config.max_num_seqs)
    prompt_tokens = max(1, min(prompt_tokens, config.max_context - new_tokens - 1))
    rng = random.Random(20_260_512)  # fixed: the same warm-up on every start
    done = threading.Event()
    left = [sequences]
    lock = threading.Lock()

    def send(output: StepOutput) -> None:
        if output.finished:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    started = time.monotonic()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(sequences):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        loop.submit(prompt, params, CallbackSink(send), request_id=f"warmup-{i}")
    if not done.wait(timeout_s):
        raise TimeoutError(f"engine warm-up: {left[0]} of {sequences} sequences unfinished after {timeout_s:g} s")
    report = WarmupReport(sequences, prompt_tokens, new_tokens, round(time.monotonic() - started, 3))
    log.info("warm-up done: %d sequences x (%d prompt + %d new tokens) in %.2f s; ready", report.sequences,
             report.prompt_tokens, report.new_tokens, report.seconds)
    return report
