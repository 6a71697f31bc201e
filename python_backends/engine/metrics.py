"""Engine statistics: counters and latency windows kept in plain Python, exported two ways.

`EngineStats` is fed by the engine (admission, first token, every token, every step) and answers the
numbers the state report and tests need (p95s, tokens/s, prefix hit rate). `TritonMetrics` mirrors them into
Triton custom metrics (`pb_utils.MetricFamily`) on the server's metrics port; it is only built inside Triton.

Every Triton metric call from the Python backend is a round trip to the server process. Observed per token
(32 a step at 32 streams, a dozen counter calls each) they held the loop thread ~12 % of a served burst's wall
time (py-spy, 2-core Xeon), so observations are kept here and published on the loop's tick (every 0.2 s).
The latency histograms are Triton HISTOGRAM families (exported with `# TYPE ... histogram`); a histogram
observation is one call, so a tick publishes at most `MAX_OBSERVATIONS_PER_FLUSH` of a histogram's
observations: all of them below that, else a uniform sample of them (reservoir sampling), which keeps the
quantiles unbiased while `_count` then counts the sample. Token rates come from the token counter, never from
a histogram's `_count` (docs/observability.md).
"""
from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]
QUEUE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
MAX_OBSERVATIONS_PER_FLUSH = 64


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100.0 * (len(ordered) - 1))))]


class EngineStats:
    def __init__(self, window: int = 512):
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.itl_s: deque[float] = deque(maxlen=4 * window)
        self.queue_wait_s: deque[float] = deque(maxlen=window)
        self.token_times: deque[tuple[float, int]] = deque()   # (time, tokens) of recent steps, for tokens/s
        self.generated_tokens = 0
        self.prompt_tokens_computed = 0
        self.sink: Any = None                                   # TritonMetrics when served by Triton

    def on_admit(self, wait_s: float) -> None:
        self.queue_wait_s.append(wait_s)
        if self.sink:
            self.sink.queue_wait.observe(wait_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft_s.append(ttft_s)
        if self.sink:
            self.sink.ttft.observe(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self.itl_s.append(itl_s)
        if self.sink:
            self.sink.itl.observe(itl_s)

    def on_step(self, new_tokens: int, prefill_tokens: int) -> None:
        now = time.monotonic()
        self.generated_tokens += new_tokens
        self.prompt_tokens_computed += prefill_tokens
        self.token_times.append((now, new_tokens))
        while self.token_times and now - self.token_times[0][0] > 5.0:
            self.token_times.popleft()
        if self.sink and new_tokens:
            self.sink.tokens.add(new_tokens)

    def tokens_per_s(self) -> float:
        if not self.token_times:
            return 0.0
        span = max(time.monotonic() - self.token_times[0][0], 1.0)
        return sum(n for _, n in self.token_times) / span

    def ttft_ms_p95(self) -> float:
        return 1000.0 * percentile(list(self.ttft_s), 95)

    def queue_wait_ms_p95(self) -> float:
        return 1000.0 * percentile(list(self.queue_wait_s), 95)


class TritonMetrics:
    """Triton custom metrics (name prefix fleet_engine_), updated from the engine loop thread."""

    def __init__(self, pb_utils: Any, labels: dict[str, str]):
        fam = pb_utils.MetricFamily
        # Triton requires each MetricFamily to outlive its Metrics: keep them all referenced.
        self._families: list[Any] = []

        def make_family(name: str, desc: str, kind: Any) -> Any:
            family = fam(name=name, description=desc, kind=kind)
            self._families.append(family)
            return family

        def make(name: str, desc: str, kind: Any, **kw: Any) -> Any:
            return make_family(name, desc, kind).Metric(labels=labels, **kw)

        gauge = lambda n, d: make(n, d, fam.GAUGE)  # noqa: E731
        counter = lambda n, d: make(n, d, fam.COUNTER)  # noqa: E731
        self.kv_used = gauge("fleet_engine_kv_blocks_used", "KV blocks referenced by sequences")
        self.kv_free = gauge("fleet_engine_kv_blocks_free", "KV blocks free (blank or evictable cached)")
        self.running = gauge("fleet_engine_running", "sequences running")
        self.waiting = gauge("fleet_engine_waiting", "sequences waiting for admission")
        self.preemptions = counter("fleet_engine_preemptions_total", "sequences preempted (recompute)")
        self.hit_rate = gauge("fleet_engine_prefix_cache_hit_rate", "prompt tokens served from the prefix cache, "
                              "share since start (rate the two counters below for a window)")
        self.prefix_queries = counter("fleet_engine_prefix_cache_queried_tokens_total",
                                      "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("fleet_engine_prefix_cache_hit_tokens_total",
                                   "prompt tokens served from the prefix cache")
        self._prefix_seen = [0, 0]
        self.tokens_per_s = gauge("fleet_engine_tokens_per_s", "generated tokens per second (5 s window)")
        self.tokens = BatchedCounter(counter("fleet_engine_generated_tokens_total", "generated tokens"))
        self.adapters = gauge("fleet_engine_adapters_loaded", "LoRA adapters resident")
        self.kv_overhead = gauge("fleet_engine_kv_overhead_max",
                                 "max over time of KV blocks in use * block_size / resident tokens")
        self._kv_overhead_max = 0.0
        def histogram(name: str, desc: str, buckets: list[float]) -> "BatchedHistogram":
            return BatchedHistogram(make_family(name, desc, fam.HISTOGRAM).Metric(labels=labels, buckets=buckets))

        self.ttft = histogram("fleet_engine_ttft_seconds", "time from arrival at the engine to first token",
                              TTFT_BUCKETS)
        self.itl = histogram("fleet_engine_inter_token_latency_seconds", "time between a stream's tokens "
                             "(sampled above 64 a tick)", ITL_BUCKETS)
        self.queue_wait = histogram("fleet_engine_queue_wait_seconds", "time from arrival to admission into the "
                                    "running batch", QUEUE_BUCKETS)
        self._preempt_seen = 0

    def update(self, engine: Any) -> None:
        pool = engine.kv.pool
        self.kv_used.set(pool.num_used)
        self.kv_free.set(pool.num_free)
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        delta = engine.scheduler.num_preemptions - self._preempt_seen
        if delta:
            self.preemptions.increment(delta)
            self._preempt_seen += delta
        self.hit_rate.set(engine.kv.hit_rate())
        for metric, i, total in ((self.prefix_queries, 0, engine.kv.prefix_queried_tokens),
                                 (self.prefix_hits, 1, engine.kv.prefix_hit_tokens)):
            if total > self._prefix_seen[i]:
                metric.increment(total - self._prefix_seen[i])
                self._prefix_seen[i] = total
        self.tokens_per_s.set(engine.stats.tokens_per_s())
        self.adapters.set(len(engine.lora.loaded()) if engine.lora else 0)
        self._kv_overhead_max = max(self._kv_overhead_max, engine.kv_overhead())
        self.kv_overhead.set(self._kv_overhead_max)
        for batched in (self.tokens, self.ttft, self.itl, self.queue_wait):
            batched.flush()


class BatchedCounter:
    """A counter added to in-process and published on flush (one server call per flush, not per add)."""

    def __init__(self, metric: Any):
        self.metric, self.pending = metric, 0.0

    def add(self, value: float) -> None:
        self.pending += value

    def flush(self) -> None:
        if self.pending:
            self.metric.increment(self.pending)
            self.pending = 0.0


class BatchedHistogram:
    """A Triton HISTOGRAM metric observed in-process and published on flush: every observation when there
    were at most `cap` since the last flush, else a uniform sample of `cap` of them (reservoir sampling)."""

    def __init__(self, metric: Any, cap: int = MAX_OBSERVATIONS_PER_FLUSH, rng: random.Random | None = None):
        self.metric, self.cap = metric, cap
        self.pending: list[float] = []
        self.seen = 0
        self._rng = rng or random.Random(0)

    def observe(self, value: float) -> None:
        self.seen += 1
        if len(self.pending) < self.cap:
            self.pending.append(value)
        else:
            slot = self._rng.randrange(self.seen)
            if slot < self.cap:
                self.pending[slot] = value

    def flush(self) -> None:
        for value in self.pending:
            self.metric.observe(value)
        self.pending, self.seen = [], 0
