"""The replica's batched histogram publishing (python_backends.engine.metrics.BatchedHistogram), against a real
prometheus_client Histogram standing in for Triton's metric (same `observe` contract): every observation when
a tick has at most `cap`, a uniform sample of `cap` otherwise, with its quantiles close to the true ones."""
from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from python_backends.engine.metrics import ITL_BUCKETS, BatchedHistogram


def _histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("itl_seconds", "test", buckets=ITL_BUCKETS, registry=registry), registry


def _count(registry: CollectorRegistry, le: str | None = None) -> float:
    if le is None:
        return registry.get_sample_value("itl_seconds_count")
    return registry.get_sample_value("itl_seconds_bucket", {"le": le})


def test_below_the_cap_every_observation_is_published_on_flush():
    metric, registry = _histogram()
    batched = BatchedHistogram(metric, cap=64)
    for v in (0.003, 0.03, 0.3):
        batched.observe(v)
    assert _count(registry) == 0  # nothing published before the tick
    batched.flush()
    assert _count(registry) == 3 and _count(registry, "0.005") == 1 and _count(registry, "0.04") == 2
    batched.flush()
    assert _count(registry) == 3  # a flush publishes each observation once


def test_above_the_cap_a_uniform_sample_keeps_the_quantiles():
    metric, registry = _histogram()
    batched = BatchedHistogram(metric, cap=64, rng=random.Random(7))
    rng = random.Random(1)
    values = []
    for _ in range(200):                      # 200 ticks of 500 observations, 20 % of them slow
        for _ in range(500):
            v = rng.uniform(0.09, 0.15) if rng.random() < 0.2 else rng.uniform(0.011, 0.019)
            values.append(v)
            batched.observe(v)
        batched.flush()
    assert _count(registry) == 200 * 64
    slow_share = 1 - _count(registry, "0.02") / _count(registry)
    true_share = sum(v > 0.02 for v in values) / len(values)
    assert abs(slow_share - true_share) < 0.02, (slow_share, true_share)
