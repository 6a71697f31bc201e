"""The TTFT queueing model: Erlang C, SLO attainment vs load, overload."""
from __future__ import annotations

import numpy as np
import pytest

from autoscale.queueing import erlang_c, ttft_stats
from autoscale.simulator.workload import PromptBins

PROMPTS = PromptBins.lognormal(2000, 1.0, 32768)


def test_erlang_c_known_values() -> None:
    assert erlang_c(np.array([1.0]), np.array([0.5]))[0] == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(np.array([2.0]), np.array([1.0]))[0] == pytest.approx(1 / 3)
    assert erlang_c(np.array([500.0]), np.array([450.0]))[0] < 0.05  # large pools rarely queue at 90 %


def _stats(util: float, backlog_s: float = 0.0):
    w = 2000 / 30000 + 300 / 3500
    n = np.array([100.0])
    return ttft_stats(np.array([util * 100 / w]), n, np.array([backlog_s]), PROMPTS.tokens, PROMPTS.prob,
                      (PROMPTS.tokens <= 4096).astype(float), 300, np.array([30000.0]), np.array([3500.0]),
                      np.array([1.0]), 4, 0.5, 0.025, 0.5, np.zeros(1))


def test_attainment_falls_and_ttft_rises_with_load() -> None:
    low, mid, high = _stats(0.5), _stats(0.85), _stats(0.98)
    assert low.slo_attainment[0] > 0.999
    assert low.slo_attainment[0] >= mid.slo_attainment[0] >= high.slo_attainment[0]
    assert low.ttft_p95_s[0] <= mid.ttft_p95_s[0] <= high.ttft_p95_s[0]
    assert low.queue_wait_p95_s[0] <= high.queue_wait_p95_s[0]


def test_overload_backlog_breaks_the_slo() -> None:
    stats = _stats(0.9, backlog_s=100.0)  # 1 s of queued work per replica
    assert stats.slo_attainment[0] == 0.0
    assert stats.ttft_p95_s[0] > 1.0


def test_prompt_distribution_matches_requirements() -> None:
    assert PROMPTS.mean == pytest.approx(2000, rel=0.02)
    assert PROMPTS.tokens.max() <= 32768
    assert 0.8 < PROMPTS.prob[PROMPTS.tokens <= 4096].sum() < 0.95
