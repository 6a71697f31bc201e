"""Fault tests with a real broker of their own: outage (paused and restarted), loader kills, router kill.
Short outages here; bench/usage/faults.py runs the issue's 30 s outage and records it."""
from __future__ import annotations

import pytest

from usage import faultcheck

pytestmark = pytest.mark.integration


def assert_exactly_once(res: dict) -> None:
    assert res["missing"] == 0, res
    assert res["duplicates"] == 0, res
    assert res["unexpected"] == 0, res
    assert res["overbilled_tokens"] == 0, res
    # The rollups chargeback reads agree with the raw rows, whatever crashed between the two commits.
    assert res["rollup_requests_off"] == 0 and res["rollup_tokens_off"] == 0, res
    assert res["emitted"] > 0


@pytest.mark.parametrize("mode", ["pause", "restart"])
def test_broker_outage_under_load(settings, tmp_path, mode):
    res = faultcheck.broker_outage(settings, tmp_path, outage_s=4, mode=mode, rate=300, warmup_s=2)
    assert_exactly_once(res)
    assert res["spooled_peak"] >= 4 * 300 * 0.5  # the events of the outage waited in the spool


def test_loader_killed_mid_batch(settings, tmp_path):
    # The two deterministic crash points; random-moment kills run in bench/usage/faults.py.
    res = faultcheck.loader_kill(settings, tmp_path, kills=0, rate=1500)
    assert res["kills"] == 2
    assert_exactly_once(res)


def test_router_killed_with_events_in_spool(settings, tmp_path):
    res = faultcheck.router_kill(settings, tmp_path, rate=1500, run_s=3, broker_down=True)
    assert_exactly_once(res)
    assert res["spooled_at_restart"] >= res["emitted"]


def test_partitions_move_to_another_loader_after_a_kill(settings, tmp_path):
    """Two real loader processes on a real broker: A dies between its lake write and its offset commit, B takes
    its partitions and re-reads that batch. B re-seeds its window on assignment, so nothing is stored twice."""
    res = faultcheck.loader_rebalance(settings, tmp_path)
    assert res["a_exit"] == 137 and res["a_rows"] > 0, res  # A did write, and died before acknowledging
    assert_exactly_once(res)
