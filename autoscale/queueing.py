"""TTFT queueing model used by the fleet simulator (vectorised over pools, one call per time step).

Model (documented in docs/benchmarks.md):
- Work: a pool with N serving replicas receives lambda requests/s. Each request costs
  P/prefill + O/decode replica-seconds (x LoRA factor). Utilisation rho = lambda * w / N.
- Overload: when rho >= 1 the excess becomes a fluid backlog (replica-seconds of work); every
  arrival waits backlog / N seconds before it can even be scheduled.
- Prefill queue: each arrival's prefill waits for other prefills. Decode steps share the GPU, slowing
  prefill by (1 - alpha * d), d = decode share of GPU time. The router picks among `c` candidate
  replicas (prefix affinity + bounded load), so the prefill queue behaves like M/G/c with c = the
  router's choice width; the probability of waiting is Erlang C and the wait tail is exponential with
  rate (c - a) / E[S] * 2 / (1 + cs^2) (M/M/c tail with the Allen-Cunneen variability correction).
- TTFT(P) = backlog wait + prefill-queue wait + P / prefill_eff + one decode iteration
  (+ the batch-preemption latency when batch work shares the replica).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import gammaincc, gammaln

_P95_GRID = np.geomspace(0.02, 200.0, 40)


@dataclass
class QueueResult:
    """Per-pool TTFT statistics for one step (arrays of shape [pools])."""

    utilisation: np.ndarray  # foreground work / capacity, capped at 1
    slo_attainment: np.ndarray  # fraction of SLO-eligible requests with TTFT <= SLO
    ttft_p95_s: np.ndarray
    queue_wait_p95_s: np.ndarray
    mean_ttft_s: np.ndarray
    extra_attainment: list[np.ndarray]  # one per `extra_slos` entry (e.g. the standard tier)


def erlang_c(c: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Probability that an arrival waits in M/M/c with offered load a (< c); vectorised, stable for large c."""
    a = np.maximum(a, 1e-12)
    log_pmf_c = c * np.log(a) - a - gammaln(c + 1.0)  # Poisson(a) pmf at c
    cdf_below = gammaincc(c, a)  # P(Poisson(a) <= c - 1)
    top = np.exp(log_pmf_c) * c / np.maximum(c - a, 1e-12)
    return np.clip(top / (cdf_below + top), 0.0, 1.0)


class TtftModel:
    """The TTFT model for a fixed set of pools and prompt bins: what does not change between steps
    (service-time moments, bin weights, constants) is computed once; `step` does the per-step part.
    Shapes: pools [K], prompt bins [B]."""

    def __init__(self, prompt_tokens: np.ndarray, prompt_prob: np.ndarray, slo_mask: np.ndarray, output_mean: float,
                 prefill: np.ndarray, decode: np.ndarray, compute_factor: np.ndarray, choice_width: int,
                 interference: float | np.ndarray, iteration_s: float, slo_s: float,
                 extra_slos: list[tuple[np.ndarray, float]] = ()) -> None:
        prob = np.asarray(prompt_prob, dtype=float)
        self.prompt_mean = float((prompt_tokens * prob).sum())
        self.prefill_per_token = compute_factor / prefill  # replica-s per prompt token
        self.decode_per_request = output_mean * compute_factor / decode  # replica-s of decode per request
        self.service0 = prompt_tokens[None, :] * self.prefill_per_token[:, None]  # [K, B] prefill time, unslowed
        self.mean_service0 = (self.service0 * prob).sum(axis=1)
        second = (self.service0 ** 2 * prob).sum(axis=1)
        self.cs2 = np.maximum(second / np.maximum(self.mean_service0 ** 2, 1e-12) - 1.0, 0.0)  # slowing keeps it
        self.prob, self.choice_width = prob, float(choice_width)
        self.interference = np.broadcast_to(np.asarray(interference, dtype=float), self.mean_service0.shape)
        self.iteration_s, self.slo_s = iteration_s, slo_s
        # (normalised bin weights, SLO) for the interactive SLO first, then each extra one
        self.slos = [(w / w.sum(), slo) for w, slo in [(prob * slo_mask, slo_s)] + [(prob * m, t) for m, t in extra_slos]]
        self.rows = np.arange(len(self.mean_service0))
        self.p95_bins = np.flatnonzero(self.slos[0][0] > 0)  # only the interactive SLO's bins enter its p95
        self.p95_weights = self.slos[0][0][self.p95_bins]

    def step(self, arrivals_per_s: np.ndarray, serving: np.ndarray, backlog_s: np.ndarray,
             extra_latency_s: np.ndarray) -> QueueResult:
        n = np.maximum(serving, 1e-9)
        lam_r = arrivals_per_s / n
        p_share = lam_r * self.prompt_mean * self.prefill_per_token
        d_share = lam_r * self.decode_per_request
        util = np.minimum(p_share + d_share, 1.0)
        slow = np.maximum(1.0 - self.interference * np.minimum(d_share, 0.999), 0.05)
        service = self.service0 / slow[:, None]  # [K, B]
        es = self.mean_service0 / slow
        c = np.minimum(self.choice_width, np.maximum(np.floor(serving), 1.0))
        rho_p = np.minimum(p_share / slow, 0.999)
        a = c * rho_p
        p_wait = erlang_c(c, a)
        theta = (c - a) / np.maximum(es, 1e-12) * 2.0 / (1.0 + self.cs2)
        backlog_wait = backlog_s / n
        base = (backlog_wait + self.iteration_s + extra_latency_s)[:, None] + service  # [K, B]
        no_capacity = serving < 1
        p_col, theta_col = p_wait[:, None], theta[:, None]
        attainments = []
        for weights, slo in self.slos:  # P(queue wait <= slo - base) over the SLO's prompt bins
            slack = slo - base
            ok = np.where(slack >= 0, 1.0 - p_col * np.exp(-theta_col * np.maximum(slack, 0)), 0.0)
            attainments.append(np.where(no_capacity, 0.0, ok @ weights))
        # p95 of TTFT over the interactive SLO's prompt bins, on a grid (log-linear interpolation).
        gap = _P95_GRID[None, None, :] - base[:, self.p95_bins, None]
        cdf = np.where(gap >= 0, 1.0 - p_col[:, :, None] * np.exp(-theta_col[:, :, None] * np.maximum(gap, 0)), 0.0)
        cdf_all = np.einsum("kbt,b->kt", cdf, self.p95_weights)  # [K, T]
        idx = np.clip((cdf_all < 0.95).sum(axis=1), 1, len(_P95_GRID) - 1)  # first grid point with cdf >= 0.95
        lo_c, hi_c = cdf_all[self.rows, idx - 1], cdf_all[self.rows, idx]
        frac = np.clip((0.95 - lo_c) / np.maximum(hi_c - lo_c, 1e-12), 0.0, 1.0)
        p95 = _P95_GRID[idx - 1] * (_P95_GRID[idx] / _P95_GRID[idx - 1]) ** frac
        ttft_p95 = np.where(no_capacity, _P95_GRID[-1], p95)
        qw = np.where(p_wait > 0.05, np.log(np.maximum(p_wait, 1e-12) / 0.05) / np.maximum(theta, 1e-12), 0.0)
        mean_ttft = backlog_wait + p_wait / np.maximum(theta, 1e-12) + es + self.iteration_s
        return QueueResult(util, attainments[0], ttft_p95, qw + backlog_wait, mean_ttft, attainments[1:])


def ttft_stats(arrivals_per_s: np.ndarray, serving: np.ndarray, backlog_s: np.ndarray,
               prompt_tokens: np.ndarray, prompt_prob: np.ndarray, slo_mask: np.ndarray,
               output_mean: float, prefill: np.ndarray, decode: np.ndarray, compute_factor: np.ndarray,
               choice_width: int, interference: float | np.ndarray, iteration_s: float, slo_s: float,
               extra_latency_s: np.ndarray, extra_slos: list[tuple[np.ndarray, float]] = ()) -> QueueResult:
    """TTFT distribution per pool for one step (a one-off `TtftModel`; the simulator keeps one per run).

    `slo_mask`/`slo_s` give the attainment and p95 (the interactive tier); `extra_slos` adds the
    attainment of further (prompt-bin mask, TTFT SLO) pairs from the same queue (other tiers)."""
    model = TtftModel(prompt_tokens, prompt_prob, slo_mask, output_mean, prefill, decode, compute_factor,
                      choice_width, interference, iteration_s, slo_s, extra_slos)
    return model.step(arrivals_per_s, serving, backlog_s, extra_latency_s)
