"""Load forecast from usage history: Holt-Winters (triple exponential smoothing) with a weekly season.

Fitted on hourly request counts per pool (the usage store's history); the weekly season (168 h)
carries both the daily curve and the weekday/weekend difference. Between refits, an online level
correction (EWMA of observed / forecast) absorbs days that run hotter or colder than the fit.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

WEEK_H = 168


class LoadForecaster:
    """Forecast requests/s for one pool at any future time (seconds since the history's end)."""

    def __init__(self, seasonal_periods: int = WEEK_H, correction_halflife_s: float = 900.0) -> None:
        self.seasonal_periods = seasonal_periods
        self.halflife_s = correction_halflife_s
        self._hourly: np.ndarray | None = None
        self.correction = 1.0

    def fit(self, hourly_requests: pd.Series, horizon_h: int = 48) -> "LoadForecaster":
        """Fit Holt-Winters on hourly counts (needs >= 2 seasons) and precompute `horizon_h` hours ahead."""
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        values = np.maximum(hourly_requests.to_numpy(dtype=float), 1.0)
        if len(values) < 2 * self.seasonal_periods:
            raise ValueError(f"Holt-Winters needs >= {2 * self.seasonal_periods} hourly points, got {len(values)}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = ExponentialSmoothing(values, trend="add", damped_trend=True, seasonal="mul",
                                         seasonal_periods=self.seasonal_periods, initialization_method="heuristic")
            fitted = model.fit(optimized=True)
        self._hourly = np.maximum(fitted.forecast(horizon_h), 0.0) / 3600.0
        in_sample = fitted.fittedvalues[-self.seasonal_periods:]
        mape = float(np.mean(np.abs(in_sample - values[-self.seasonal_periods:]) / values[-self.seasonal_periods:]))
        log.info("Holt-Winters fitted on %d hours (season %d h); last-week in-sample MAPE %.1f %%",
                 len(values), self.seasonal_periods, 100 * mape)
        return self

    def predict(self, seconds_ahead: np.ndarray | float) -> np.ndarray:
        """Requests/s at seconds after the end of the history (linear between hourly points), corrected."""
        if self._hourly is None:
            raise RuntimeError("fit() first")
        if isinstance(seconds_ahead, float | int):  # the simulator's hot path: plain arithmetic, no arrays
            h = seconds_ahead / 3600.0 - 0.5  # hourly means sit mid-hour
            last = len(self._hourly) - 1
            i = min(max(int(h // 1), 0), last)
            frac = min(max(h - i, 0.0), 1.0) if i < last else 0.0
            nxt = self._hourly[min(i + 1, last)]
            return float(self._hourly[i] + (nxt - self._hourly[i]) * frac) * self.correction
        hours = np.asarray(seconds_ahead, dtype=float) / 3600.0 - 0.5
        grid = np.arange(len(self._hourly))
        return np.interp(hours, grid, self._hourly) * self.correction

    def observe(self, seconds_ahead: float, observed_per_s: float, dt_s: float) -> None:
        """Online level correction: EWMA of observed / forecast (bounded to 0.5..2)."""
        predicted = float(self.predict(float(seconds_ahead))) / self.correction
        if predicted <= 0:
            return
        alpha = 1.0 - 0.5 ** (dt_s / self.halflife_s)
        ratio = min(max(observed_per_s / predicted, 0.5), 2.0)
        self.correction += alpha * (ratio - self.correction)
