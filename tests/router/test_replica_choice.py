"""Replica choice: prefix affinity, bounded load, adapter preference, round-robin fallback with caps,
regions, and the gateway's quota and rate limit."""
import time

import pytest

from common.hashing import prefix_block_hashes
from router_service.errors import RouterError
from router_service.gateway import Gateway
from router_service.regions import candidate_tiers
from router_service.registry_cache import ReplicaInfo
from router_service.replica_choice import ChoiceParams, ReplicaChooser
from router_service.replica_state import ReplicaStateTable


def _replicas(n, region="local"):
    return [ReplicaInfo(f"r{i}", "m", "1", region, f"127.0.0.1:{i}", "", "serving") for i in range(n)]


def _report(table, rid, hashes=(), adapters=(), **kw):
    table.apply({"replica_id": rid, "block_size": 16, "full_snapshot": True, "prefix_hashes": list(hashes),
                 "adapters_loaded": list(adapters), **kw})


PROMPT = list(range(1000, 1256))  # 16 blocks
HASHES = prefix_block_hashes(PROMPT, 16)


def test_prefers_the_replica_holding_the_prefix():
    table = ReplicaStateTable()
    for rid in ("r0", "r1", "r2"):
        _report(table, rid, HASHES if rid == "r2" else ())
    chooser = ReplicaChooser(table, ChoiceParams())
    p = chooser.place(_replicas(3), "standard", len(PROMPT), 32, HASHES, "")
    assert p.replica.replica_id == "r2" and p.cached_tokens == 256 and p.policy == "cost"


def test_bounded_load_skips_an_overloaded_affine_replica():
    table = ReplicaStateTable()
    for rid in ("r0", "r1", "r2"):
        _report(table, rid, HASHES if rid == "r2" else ())
    chooser = ReplicaChooser(table, ChoiceParams(epsilon=0.25, replica_concurrency=100))
    chooser.load.update(r0=100.0, r1=100.0, r2=2000.0)
    p = chooser.place(_replicas(3), "standard", len(PROMPT), 32, HASHES, "")
    assert p.replica.replica_id in ("r0", "r1")


def test_routed_prefix_is_remembered_before_the_next_report():
    table = ReplicaStateTable()
    for rid in ("r0", "r1", "r2", "r3"):
        _report(table, rid)
    chooser = ReplicaChooser(table, ChoiceParams(replica_concurrency=100))
    first = chooser.place(_replicas(4), "standard", len(PROMPT), 32, HASHES, "")
    chooser.release(first)
    again = chooser.place(_replicas(4), "standard", len(PROMPT), 32, HASHES, "")
    assert again.replica.replica_id == first.replica.replica_id and again.cached_tokens == 256


def test_adapter_requests_prefer_replicas_with_the_adapter_loaded():
    table = ReplicaStateTable()
    _report(table, "r0")
    _report(table, "r1", adapters=["sql-lora"])
    chooser = ReplicaChooser(table, ChoiceParams())
    assert chooser.place(_replicas(2), "standard", 40, 16, prefix_block_hashes(list(range(40)), 16),
                         "sql-lora").replica.replica_id == "r1"


def test_without_reports_round_robin_with_per_replica_caps():
    chooser = ReplicaChooser(ReplicaStateTable(), ChoiceParams(replica_concurrency=2, batch_share=0.5))
    picks = [chooser.place(_replicas(3), "standard", 10, 10, None, "") for _ in range(6)]
    assert [p.replica.replica_id for p in picks] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert all(p.policy == "round_robin" for p in picks)
    assert chooser.place(_replicas(3), "standard", 10, 10, None, "") is None  # every replica at its cap
    chooser.release(picks[0])
    assert chooser.place(_replicas(3), "batch", 10, 10, None, "").replica.replica_id == "r0"
    chooser.release(picks[3])
    assert chooser.place(_replicas(3), "batch", 10, 10, None, "") is None  # batch share of r0 (1 of 2) is used


def test_stale_reports_fall_back_to_round_robin():
    table = ReplicaStateTable(stale_after_s=0.05)
    _report(table, "r0", HASHES)
    time.sleep(0.1)
    chooser = ReplicaChooser(table, ChoiceParams())
    assert chooser.block_size(_replicas(2)) is None


def test_draining_replicas_take_no_new_work():
    table = ReplicaStateTable()
    _report(table, "r0", draining=True)
    _report(table, "r1")
    chooser = ReplicaChooser(table, ChoiceParams())
    assert {chooser.place(_replicas(2), "standard", 16, 8, HASHES[:1], "").replica.replica_id
            for _ in range(4)} == {"r1"}


def test_only_batch_overflows_to_another_region():
    replicas = _replicas(2, "eu") + [ReplicaInfo("us0", "m", "1", "us", "x", "", "serving")]
    assert [[r.replica_id for r in g] for g in candidate_tiers(replicas, "eu", "interactive")] == [["r0", "r1"]]
    assert [[r.replica_id for r in g] for g in candidate_tiers(replicas, "eu", "batch")] == [["r0", "r1"], ["us0"]]


def test_rate_limit_is_a_token_bucket_per_caller():
    gw = Gateway(rate_per_s=10, burst=3)
    for _ in range(3):
        gw.check_rate("a")
    with pytest.raises(RouterError, match="rate limit") as info:
        gw.check_rate("a")
    assert info.value.retry_after_ms <= 101
    gw.check_rate("b")  # other callers are not affected
