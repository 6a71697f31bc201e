"""Bin packing onto 8-GPU nodes: TP4 groups on one node, small replicas on partial nodes, two regions."""
from __future__ import annotations

from autoscale.placement import Cluster, RegionNodes, pack


def test_tp4_takes_an_aligned_half_of_one_node() -> None:
    region = RegionNodes("a", nodes=2)
    first, second = region.place(4), region.place(4)
    assert first.node == second.node  # best fit: the half-used node is filled first
    assert {first.gpu_ids, second.gpu_ids} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_tp4_needs_four_free_gpus_on_one_node() -> None:
    region = RegionNodes("a", nodes=2)
    region.used[0, :5] = True  # fragmented: 3 free on each node, 6 in total
    region.used[1, 2:7] = True
    assert region.place(4) is None  # enough GPUs in the region, never 4 on one node
    assert region.place(1) is not None  # a small replica still fits


def test_small_replicas_pack_onto_partial_nodes_not_empty_ones() -> None:
    region = RegionNodes("a", nodes=3)
    region.place(4)  # node 0 half full
    for _ in range(4):
        assert region.place(1).node == 0
    assert (region.free_per_node == [0, 8, 8]).all()


def test_drain_order_frees_the_emptiest_node_first() -> None:
    cluster = Cluster({"a": (3, 8)})
    slots = [cluster.place("a", 1) for _ in range(9)]  # node 0 full, node 1 has one
    order = cluster.drain_order(slots)
    assert order[0].node == 1


def test_requirements_fleet_fits_in_two_regions() -> None:
    cluster = Cluster({"region-a": (96, 8), "region-b": (96, 8)})
    plan = pack(cluster, [("region-a", 4, 113), ("region-a", 1, 226), ("region-b", 4, 113), ("region-b", 1, 226)])
    assert sum(len(v) for v in plan.values()) == 2 * (113 + 226)
    summary = cluster.summary()
    for region in ("region-a", "region-b"):
        assert summary[region]["used"] == 113 * 4 + 226
        assert summary[region]["partial_nodes"] <= 1  # packing leaves at most one partly used node
        assert summary[region]["empty_nodes"] >= 4
