"""Holt-Winters forecast from usage history (weekly season carries the daily curve)."""
from __future__ import annotations

import numpy as np
import pytest

from autoscale.forecast import LoadForecaster
from autoscale.simulator.settings import SimSettings
from autoscale.simulator.workload import DAY_S, WorkloadModel


def test_forecast_tracks_the_next_day_and_corrects_level() -> None:
    settings = SimSettings()
    wl = WorkloadModel(settings)
    region, model = settings.pools()[1]
    end = (3 * 7 + 2) * DAY_S
    history = wl.hourly_history(region, model.traffic_share, end, 3, seed=11)
    fc = LoadForecaster().fit(history, horizon_h=30)
    t = np.arange(0, DAY_S, 600.0)
    truth = wl.region_rate(t + end, region) * model.traffic_share
    pred = fc.predict(t)
    assert np.mean(np.abs(pred - truth) / truth) < 0.10
    peak = int(np.argmax(truth))
    assert pred[peak] == pytest.approx(truth[peak], rel=0.1)
    for step in range(200):  # a day running 20 % hot: the online correction learns it
        fc.observe(step * 10.0, 1.2 * float(fc.predict(step * 10.0)) / fc.correction, 10.0)
    assert fc.correction == pytest.approx(1.2, rel=0.05)


def test_forecast_needs_two_seasons() -> None:
    import pandas as pd

    with pytest.raises(ValueError):
        LoadForecaster().fit(pd.Series(np.ones(100)))
