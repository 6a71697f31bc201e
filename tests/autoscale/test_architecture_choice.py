"""Ours' per-pool serving architecture (autoscale/simulator/architecture.py): split prefill/decode pools
where the capacity model says they need fewer replica-seconds per request and hold the SLO, colocated
where not. Planned on the pool's smooth daily curve (no forecaster fit: fast)."""
from __future__ import annotations

import pytest

from autoscale.simulator.architecture import SLO_ATTAINMENT_REQUIRED
from autoscale.simulator.engine import prepare
from autoscale.simulator.settings import SimSettings


def _choices(**overrides):
    scale = overrides.pop("traffic_scale", 1.0)
    nodes = overrides.pop("nodes_per_region", None)
    settings = SimSettings(step_s=60.0, **overrides)
    for region in settings.assumptions["regions"]:
        region["nodes"] = nodes or region["nodes"]
    workload = settings.assumptions["workload"]
    for key in ("requests_per_day", "peak_requests_per_s", "batch_requests_per_day"):
        workload[key] *= scale
    inputs = prepare(settings, with_forecast=False)
    return {(region.name, model.name): choice for (region, model), choice in zip(settings.pools(), inputs.choices)}


def test_busy_pools_at_the_default_reuse_are_split() -> None:
    for choice in _choices().values():
        assert choice.architecture == "disaggregated"
        planned = choice.replica_seconds_per_request
        assert planned["disaggregated"] < planned["colocated"]
        assert choice.per_request_work["disaggregated"] < choice.per_request_work["colocated"]
        assert all(choice.eligible.values()) and set(choice.stream_tokens_per_s.values()) == {40}


def test_small_pools_stay_colocated_where_one_floor_and_one_buffer_cost_less() -> None:
    for choice in _choices(traffic_scale=0.05).values():  # 5 M requests/day: the floors dominate
        assert choice.architecture == "colocated"
        assert choice.replica_seconds_per_request["colocated"] < choice.replica_seconds_per_request["disaggregated"]
        # the per-request work alone would still favour the split: the floors and buffers decide
        assert choice.per_request_work["disaggregated"] < choice.per_request_work["colocated"]


def test_choice_is_per_model_pool() -> None:
    """At 80 % reuse the small model's prefill pool is tiny: it stays colocated, the large one splits."""
    choices = _choices(reuse_override=0.8)
    for (_, model), choice in choices.items():
        assert choice.architecture == ("disaggregated" if model.startswith("large") else "colocated"), model


def test_a_split_that_misses_the_slo_at_the_design_point_is_not_chosen() -> None:
    """Without prefix reuse (and a fleet big enough for either plan) the large model's prefill pool queues
    past the TTFT SLO at the peak: cheaper, but not eligible."""
    choice = _choices(reuse_override=0.0, nodes_per_region=200)[("region-a", "large-70b-fp8")]
    assert choice.fleet_fit == {"colocated": 1.0, "disaggregated": 1.0}
    assert choice.replica_seconds_per_request["disaggregated"] < choice.replica_seconds_per_request["colocated"]
    assert choice.design_point_slo["disaggregated"] < SLO_ATTAINMENT_REQUIRED <= choice.design_point_slo["colocated"]
    assert choice.architecture == "colocated"


def test_a_plan_the_region_cannot_hold_does_not_hold_the_slo() -> None:
    """On the requirements' 768 GPUs per region without reuse the colocated plan does not fit (the peak's
    work exceeds what the region holds), the split one fits better: neither holds the SLO, the cheaper wins."""
    choice = _choices(reuse_override=0.0)[("region-a", "large-70b-fp8")]
    assert choice.fleet_fit["colocated"] < choice.fleet_fit["disaggregated"] < 1.0
    assert choice.design_point_slo["colocated"] == 0.0
    assert not any(choice.eligible.values())
    assert choice.architecture == "disaggregated"


@pytest.mark.parametrize("forced", ["colocated", "disaggregated"])
def test_ours_architecture_can_be_forced(forced: str) -> None:
    settings = SimSettings(step_s=60.0, ours_architecture=forced)
    inputs = prepare(settings, with_forecast=False)
    roles = {unit.role for unit in inputs.units("ours")}
    assert roles == ({"colocated"} if forced == "colocated" else {"prefill", "decode"})
    assert {unit.role for unit in inputs.units("disaggregated")} == {"prefill", "decode"}
    assert {unit.role for unit in inputs.units("reactive-signals")} == {"colocated"}
