"""Synthetic fleet workload: a diurnal + weekly request curve per region, noise and bursts, batch
submissions, the prompt-length distribution, and the usage history the forecaster learns from.

Rates are per-step aggregates (requests/s per pool), never per-request objects, so a day of
100 M requests is a few arrays. The curve's sharpness is solved so that the global weekday
peak/mean ratio equals peak_requests_per_s / (requests_per_day / 86400).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from autoscale.simulator.settings import Region, SimSettings, Workload

DAY_S = 86400.0


def _shape(local_h: np.ndarray, wl: Workload, sharpness: float) -> np.ndarray:
    """Raised-cosine day curve with a night floor; 1.0 at the local peak hour."""
    bump = ((1.0 + np.cos(2.0 * np.pi * (local_h - wl.peak_hour_local) / 24.0)) / 2.0) ** sharpness
    return wl.night_floor + (1.0 - wl.night_floor) * bump


def _weekly(t_s: np.ndarray, region: Region, wl: Workload) -> np.ndarray:
    day = np.floor((t_s / 3600.0 + region.utc_offset_h) / 24.0).astype(int) % 7
    return np.where(day >= 5, wl.weekend_factor, 1.0)


def _global_weekday(t_s: np.ndarray, regions: list[Region], wl: Workload, sharpness: float) -> np.ndarray:
    return sum(r.traffic_share * _shape(t_s / 3600.0 + r.utc_offset_h, wl, sharpness) for r in regions)


def solve_sharpness(regions: list[Region], wl: Workload) -> float:
    """Bisection on the curve exponent so the global peak/mean matches the requirements' peak."""
    target = wl.peak_requests_per_s / (wl.requests_per_day / DAY_S)
    t = np.arange(0, DAY_S, 60.0)
    lo, hi = 0.05, 60.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        g = _global_weekday(t, regions, wl, mid)
        ratio = g.max() / g.mean()
        lo, hi = (mid, hi) if ratio < target else (lo, mid)
    return math.sqrt(lo * hi)


@dataclass
class PromptBins:
    """The prompt-length distribution as probability-weighted bins (lognormal, capped)."""

    tokens: np.ndarray  # representative prompt length per bin
    prob: np.ndarray
    mean: float

    @classmethod
    def lognormal(cls, mean: float, sigma: float, cap: float, n_bins: int = 16) -> "PromptBins":
        from scipy.stats import norm

        mu = math.log(mean) - sigma ** 2 / 2
        edges = np.geomspace(8.0, cap, n_bins + 1)
        z = (np.log(edges) - mu) / sigma
        cdf, partial = norm.cdf(z), norm.cdf(z - sigma)  # partial: share of E[X] below each edge
        cdf[0], cdf[-1], partial[0] = 0.0, 1.0, 0.0  # mass below 8 joins the first bin, above the cap the last
        prob = np.diff(cdf)
        tokens = np.clip(mean * np.diff(partial) / np.maximum(prob, 1e-300), edges[:-1], edges[1:])  # E[X | bin]
        tokens[-1] = cap if prob[-1] > 0 and tokens[-1] >= cap else tokens[-1]
        return cls(tokens, prob, float((tokens * prob).sum()))


@dataclass
class PoolTraffic:
    """Per-step arrival rates for one (region, model) pool."""

    requests_per_s: np.ndarray  # interactive + standard, noisy, with bursts
    batch_submitted_per_s: np.ndarray  # batch requests submitted (served whenever, by the deadline)
    smooth_requests_per_s: np.ndarray  # the curve without noise or bursts (for static sizing)


class WorkloadModel:
    """Builds per-pool arrival arrays on a time grid and hourly usage history for forecasting."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.wl = settings.workload
        self.regions = settings.regions
        self.sharpness = solve_sharpness(self.regions, self.wl)
        t = np.arange(0, DAY_S, 60.0)
        self._norm = float(_global_weekday(t, self.regions, self.wl, self.sharpness).mean())
        self.prompts = PromptBins.lognormal(self.wl.prompt_tokens_mean, self.wl.prompt_tokens_sigma,
                                            self.wl.prompt_tokens_max)

    def region_rate(self, t_s: np.ndarray, region: Region) -> np.ndarray:
        """Smooth requests/s of one region (all models, interactive + standard) at times t_s."""
        base = self.wl.requests_per_day / DAY_S / self._norm
        shape = _shape(t_s / 3600.0 + region.utc_offset_h, self.wl, self.sharpness)
        return base * region.traffic_share * shape * _weekly(t_s, region, self.wl)

    def _bursts(self, t_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        factor = np.ones_like(t_s)
        span_days = (t_s[-1] - t_s[0]) / DAY_S
        for _ in range(rng.poisson(self.wl.bursts_per_day_per_region * span_days)):
            start = rng.uniform(t_s[0], t_s[-1])
            length = rng.uniform(*self.wl.burst_minutes) * 60.0
            amp = rng.uniform(*self.wl.burst_amplitude)
            factor += amp * ((t_s >= start) & (t_s < start + length))
        return factor

    def batch_rate(self, t_s: np.ndarray, region: Region) -> np.ndarray:
        """Batch requests/s submitted: uniform over the local submit window on weekdays."""
        lo, hi = self.wl.batch_submit_hours_local
        local_h = (t_s / 3600.0 + region.utc_offset_h) % 24.0
        inside = (local_h >= lo) & (local_h < hi)
        per_s = self.wl.batch_requests_per_day * region.traffic_share / ((hi - lo) * 3600.0)
        return np.where(inside, per_s, 0.0) * _weekly(t_s, region, self.wl)

    def pool_traffic(self, t_s: np.ndarray, region: Region, model_share: float, seed: int) -> PoolTraffic:
        rng = np.random.default_rng(seed)
        smooth = self.region_rate(t_s, region) * model_share
        noise = np.exp(rng.normal(0.0, self.wl.noise_sigma, t_s.shape) - self.wl.noise_sigma ** 2 / 2)
        noisy = smooth * noise * self._bursts(t_s, rng)
        return PoolTraffic(noisy, self.batch_rate(t_s, region) * model_share, smooth)

    def hourly_history(self, region: Region, model_share: float, end_s: float, weeks: int, seed: int) -> pd.Series:
        """Requests per hour for `weeks` weeks before end_s: what the usage store would hold."""
        t = np.arange(end_s - weeks * 7 * DAY_S, end_s, 60.0)
        traffic = self.pool_traffic(t, region, model_share, seed)
        per_hour = traffic.requests_per_s.reshape(-1, 60).sum(axis=1) * 60.0
        index = pd.date_range("2026-01-05", periods=len(per_hour), freq="h")  # a Monday, for readability
        return pd.Series(per_hour, index=index)
