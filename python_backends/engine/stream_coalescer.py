"""StreamCoalescer: under load, send a stream's tokens a few at a time instead of one response per token.

Every streamed response costs CPU all along the path - the Python backend's IPC `send`, tritonserver, the
router, the client (and, for callers of the ensemble `llm`, its detokenizing postprocessing model) - on the
same cores that run the model's step. With many streams, that is one response per stream per step. While a step has at least `min_rows`
rows, a stream's tokens are held until `interval` have gathered (vLLM's `stream_interval` does the same);
tokens/s rises and the stream arrives in small chunks. Never held: a stream's first tokens (TTFT is not
delayed), its final output, the interactive tier (smooth streaming is what it pays for), and anything once
the load falls below `min_rows` or the sequence sits out a step - a held token waits at most one step.
"""
from __future__ import annotations

from python_backends.engine.engine import StepOutput
from python_backends.engine.sequence import Priority


class StreamCoalescer:
    def __init__(self, interval: int = 1, min_rows: int = 8):
        if interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token (got {interval})")
        self.interval, self.min_rows = interval, max(1, min_rows)
        self._held: dict[int, StepOutput] = {}   # seq_id -> tokens released by the engine, not yet sent

    def release(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The outputs to send now, from one step's outputs (and what earlier steps held)."""
        if self.interval == 1 and not self._held:
            return outputs
        busy = len(outputs) >= self.min_rows
        ready: list[StepOutput] = []
        seen: set[int] = set()
        for out in outputs:
            sid = out.seq.seq_id
            seen.add(sid)
            held = self._held.pop(sid, None)
            if held is not None:
                out = StepOutput(out.seq, held.token_ids + out.token_ids, out.finish_reason)
            if out.finished:
                ready.append(out)
            elif not out.token_ids:
                continue                          # nothing to say yet (a stop string may be forming)
            elif self._holds(out, busy):
                self._held[sid] = out
            else:
                ready.append(out)
        for sid in [sid for sid in self._held if sid not in seen]:
            ready.append(self._held.pop(sid))    # sat this step out (preempted, prefilling): do not wait
        return ready

    def _holds(self, out: StepOutput, busy: bool) -> bool:
        # out carries every released token not yet sent, so the stream has sent some iff the engine released more
        started = out.seq.num_emitted > len(out.token_ids)
        return (busy and started and out.seq.priority != Priority.INTERACTIVE
                and len(out.token_ids) < self.interval)
