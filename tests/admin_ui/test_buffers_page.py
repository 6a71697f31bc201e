"""Warm buffers page: idle / serving vs the target per pool, buffer cost per day, measured cold starts, and
recorded autoscaler decisions with their signals, charted over time."""
from __future__ import annotations

import json

from tests.admin_ui.stack import MODEL


def test_pools_show_idle_vs_target_and_the_buffer_cost(stack, page):
    at = page("buffers")
    assert not at.exception, at.exception
    pools = at.dataframe[0].value.set_index("version")
    v1 = pools.loc["1"]
    assert v1["serving"] == 2 and v1["target_idle"] == 1 and v1["idle"] + v1["busy"] == 2
    assert v1["buffer_cost_per_day"] == 1 * 1 * 24 * 2.5, "1 idle replica x 1 GPU x 24 h x 2.5 per GPU-hour"
    assert any(m.label.startswith("buffer cost per day (USD)") for m in at.metric)


def test_recorded_decisions_and_cold_starts_are_shown_with_their_signals(stack, page):
    folder = stack.data_dir / "autoscale"
    folder.mkdir(parents=True)
    (folder / "decisions.jsonl").write_text(
        json.dumps({"ts": 1790000000, "pool": f"{MODEL}/1", "serving": 1, "starting": 0, "desired": 2,
                    "signals": {"load": 0.9, "kv": 0.4, "waiting": 3, "ttft_p95_s": 1.2}, "reason": "scale up"}) + "\n"
        + json.dumps({"ts": 1790000300, "pool": f"{MODEL}/1", "serving": 2, "starting": 0, "desired": 1,
                      "signals": {"load": 0.1, "kv": 0.05, "waiting": 0, "ttft_p95_s": 0.2},
                      "reason": "scale down (drain)"}) + "\n")
    (folder / "cold_starts.json").write_text(json.dumps({MODEL: [41.0, 39.0, 44.5]}))
    at = page("buffers")
    assert not at.exception, at.exception
    decisions = at.dataframe[-1].value
    assert decisions["why"].tolist()[0].startswith("scale down (drain): KV used (0..1) 0.05")
    assert "waiting 3" in decisions["why"].tolist()[1] and decisions["desired"].tolist() == [1, 2]
    colds = next(d.value for d in at.dataframe if "cold_starts" in d.value.columns)
    assert colds.iloc[0]["cold_starts"] == 3 and colds.iloc[0]["p50_s"] == 41.0
    assert len(at.get("plotly_chart")) == 2, "decisions and their signals over time"
