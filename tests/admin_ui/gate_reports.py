"""Quality-gate reports as build-engines stores them (build_engines.quality_gate.make_report), for tests that
seed registry versions without running a build: the router's rollout tests and the admin UI's stack."""
from __future__ import annotations

from build_engines import quality_gate as qg


def gate_report(agreement: float, dtype: str = "bf16", delta: float = 0.02) -> dict:
    """The report of a candidate whose top-1 matches the reference at `agreement` of 100 positions, each
    `delta` away in logprob (the thresholds of `dtype` decide pass/fail)."""
    ref = qg.Reference([[1]], [list(range(100))], [list(range(100))], [[-0.5] * 100])
    hits = round(agreement * 100)
    got = qg.Scored([list(range(hits)) + [-1] * (100 - hits)], [[-0.5 - delta] * 100])
    return qg.make_report(ref, got, dtype, qg.GateOptions(), "python_backends.engine (cpu)", {})
