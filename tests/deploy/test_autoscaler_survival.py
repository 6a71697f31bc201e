"""The controller loop survives what killed the autoscaler in Kubernetes: one pool's actuator errors (an API
422/500) and an unwritable decisions file never stop the other pools or the loop (fast, no namespaces; the
container itself runs in test_autoscaler_container.py)."""
from __future__ import annotations

from autoscale.actuators import PoolSpec, ReplicaCounts
from autoscale.controller import Controller, PoolConfig
from autoscale.signals import Signals


class OneBrokenPool:
    """Actuator interface; every call for the `broken` model raises as the API client does on a 500."""

    def __init__(self) -> None:
        self.scaled: dict[str, int] = {}

    def _check(self, pool: PoolSpec) -> None:
        if pool.model == "broken":
            raise RuntimeError("(500) etcdserver: request timed out")

    def adopt(self, pool: PoolSpec) -> None:
        self._check(pool)

    def counts(self, pool: PoolSpec) -> ReplicaCounts:
        self._check(pool)
        return ReplicaCounts(serving=self.scaled.get(pool.name, 0))

    def scale(self, pool: PoolSpec, desired: int) -> None:
        self._check(pool)
        self.scaled[pool.name] = desired

    def cold_start_s(self, pool: PoolSpec) -> float | None:
        return 30.0


def test_one_pools_errors_and_an_unwritable_decisions_file_do_not_stop_the_others(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the decisions folder should be")
    pools = [PoolConfig(PoolSpec("broken", "1"), min_replicas=1),
             PoolConfig(PoolSpec("meta-llama/Llama-3.1-70B", "v2+lora"), min_replicas=2)]
    actuator = OneBrokenPool()
    ctl = Controller(pools, actuator, "http://unused", signal_reader=lambda p: Signals(model=p.spec.model),
                     decisions_path=blocker / "autoscale" / "decisions.jsonl")
    for step in range(3):
        decisions = ctl.tick(float(step))
    assert [d.pool for d in decisions] == [pools[1].spec.name]
    assert actuator.scaled == {pools[1].spec.name: 2}  # scaled although the decision could not be written
