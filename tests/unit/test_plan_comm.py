"""nabla.plan.comm: one collective's time on a cluster, checked against alpha-beta arithmetic done by hand
(A100 preset: NVLink 3.4 us/step at 300 GB/s x 0.775, network 9.6 us/step at 25 GB/s x 0.91)."""

from __future__ import annotations

import pytest

from nabla import collectives as C
from nabla.collectives import CommEvent
from nabla.errors import ShardingError
from nabla.plan import Cluster, Hardware, Tier, event_time, phases

CL = Cluster(Hardware.preset("a100-sxm-80gb"), nodes=4, devices_per_node=8)
DP_TP = CL.mesh("m", (4, 8), ("dp", "tp"))
WIDE = CL.mesh("w", (2, 16), ("a", "b"))
NV_LAT, NV_BW = 3.4e-6, 300e9 * 0.775
NET_LAT, NET_BW = 9.6e-6, 25e9 * 0.91
MiB = 2**20


def test_all_reduce_inside_a_node():
    B = 8 * MiB  # local block; ring over tp = 8 sends 2 * 7/8 * B
    e = CommEvent("all_reduce", ("tp",), 2 * 7 * B // 8, 8)
    assert event_time(e, CL, DP_TP) == pytest.approx(2 * 7 * NV_LAT + 14680064 / NV_BW)


def test_all_gather_across_nodes():
    B = 1 * MiB  # shard; ring over dp = 4 (one GPU per node) sends 3 * B
    e = CommEvent("all_gather", ("dp",), 3 * B, 4)
    assert event_time(e, CL, DP_TP) == pytest.approx(3 * NET_LAT + 3145728 / NET_BW)


def test_hierarchical_all_reduce_is_the_three_phase_formula():
    B = 16 * MiB  # 16777216 bytes over b = 16 = 8 in each of 2 nodes
    e = CommEvent("all_reduce", ("b",), 2 * 15 * B // 16, 16)  # 31457280 bytes in a flat ring
    assert CL.tier(WIDE, ["b"]) == Tier("hierarchical", 8, 2)
    rs_inside = 7 * NV_LAT + (7 / 8 * 16777216) / NV_BW  # reduce_scatter over 8: 14680064 bytes
    ar_across = 2 * NET_LAT + (2 * 1 / 2 * 16777216 / 8) / NET_BW  # all_reduce over 2 on B/8: 2097152 bytes
    ag_inside = 7 * NV_LAT + (7 / 8 * 16777216) / NV_BW  # all_gather over 8: 14680064 bytes
    assert event_time(e, CL, WIDE) == pytest.approx(rs_inside + ar_across + ag_inside)
    assert [(p.kind, p.tier, p.group, p.bytes) for p in phases(e, Tier("hierarchical", 8, 2))] == [
        ("reduce_scatter", "nvlink", 8, 14680064.0), ("all_reduce", "network", 2, 2097152.0),
        ("all_gather", "nvlink", 8, 14680064.0)]
    # the three phases beat a flat ring whose every step would run at network speed
    flat = 30 * NET_LAT + 31457280 / NET_BW
    assert event_time(e, CL, WIDE) < flat


def test_hierarchical_reduce_scatter_and_all_gather():
    B = 16 * MiB
    rs = CommEvent("reduce_scatter", ("b",), 15 * B // 16, 16)
    assert event_time(rs, CL, WIDE) == pytest.approx(
        7 * NV_LAT + 7 / 8 * B / NV_BW  # inside, on B
        + 1 * NET_LAT + 1 / 2 * B / 8 / NET_BW)  # across, on B/8
    s = 1 * MiB  # all_gather of a 1 MiB shard over 16
    ag = CommEvent("all_gather", ("b",), 15 * s, 16)
    assert event_time(ag, CL, WIDE) == pytest.approx(
        1 * NET_LAT + 1 * s / NET_BW  # across 2 nodes: (2-1) x 1 MiB
        + 7 * NV_LAT + 7 * 2 * s / NV_BW)  # inside 8, on the 2 MiB gathered: (8-1) x 2 MiB


def test_hierarchical_all_to_all_prices_the_cross_node_part_on_the_network():
    B = 16 * MiB
    e = CommEvent("all_to_all", ("b",), 15 * B // 16, 16)  # 15/16 of B leaves each device
    inside = 7 * NV_LAT + 7 / 16 * B / NV_BW  # 7 peers on the node get B/16 each
    across = 1 * NET_LAT + 8 / 16 * B / NET_BW  # 8 peers on the other node
    assert event_time(e, CL, WIDE) == pytest.approx(max(inside, across))


def test_collective_permute():
    B = 4 * MiB
    assert event_time(CommEvent("collective_permute", ("tp",), B, 8), CL, DP_TP) == pytest.approx(NV_LAT + B / NV_BW)
    assert event_time(CommEvent("collective_permute", ("b",), B, 16), CL, WIDE) == pytest.approx(
        NET_LAT + B / NET_BW)  # some device's block crosses a node


def test_multi_axis_and_empty_events():
    B = 8 * MiB  # all_reduce over dp x tp = 32: hierarchical 8 x 4
    e = CommEvent("all_reduce", ("dp", "tp"), 2 * 31 * B // 32, 32)
    assert event_time(e, CL, DP_TP) == pytest.approx(
        2 * (7 * NV_LAT + 7 / 8 * B / NV_BW) + 2 * 3 * NET_LAT + 2 * 3 / 4 * B / 8 / NET_BW)
    assert event_time(CommEvent("all_reduce", ("tp",), 0, 8), CL, DP_TP) == 0.0


def test_unknown_kind_is_named():
    with pytest.raises(ShardingError, match="unknown collective kind 'broadcast'"):
        event_time(CommEvent("broadcast", ("tp",), 8, 8), CL, DP_TP)


def test_a_kind_registered_from_outside_is_priced_by_the_legs_its_entry_gives():
    """The registry entry says how a kind runs over nodes; the pricer only adds its legs (one after another, or
    at once). A broadcast as a tree: across the nodes first, then inside each."""
    def legs(sent, k, k_in, k_out):
        return (("all_gather", "network", k_out, sent), ("all_gather", "nvlink", k_in, sent))

    moves = C.REGISTRY["all_gather"].move
    C.register(C.Collective("broadcast", lambda B, k: B, lambda k: 1, "broadcast", moves, legs=legs))
    try:
        B = 4 * MiB
        e = C.event("broadcast", ("b",), B, 16)
        after = (1 * NET_LAT + B / NET_BW) + (7 * NV_LAT + B / NV_BW)  # ring steps of all_gather over 2, then 8
        assert (e.kind, e.bytes, event_time(e, CL, WIDE)) == ("broadcast", B, pytest.approx(after))
        C.register(C.Collective("broadcast", lambda B, k: B, lambda k: 1, "broadcast", moves, legs=legs,
                                legs_at_once=True))
        assert event_time(e, CL, WIDE) == pytest.approx(max(NET_LAT + B / NET_BW, 7 * NV_LAT + B / NV_BW))
        C.register(C.Collective("broadcast", lambda B, k: B, lambda k: 1, "broadcast", moves))  # no legs: whole
        assert event_time(e, CL, WIDE) == pytest.approx(NET_LAT + B / NET_BW)  # on the network, 1 ring step
    finally:
        C.unregister("broadcast")
    with pytest.raises(ShardingError, match="unknown collective kind 'broadcast'"):
        event_time(e, CL, WIDE)


def test_an_all_reduce_across_many_nodes_runs_as_nccl_s_tree_when_that_is_faster():
    """NCCL's tuner prices a ring (2(k-1) network latencies) and a double binary tree (2 log2(k) hops of 50 us
    at 0.9 of the bandwidth; NVIDIA/nccl src/graph/tuning.cc) and runs the faster: at 2,048 nodes a 25 MiB
    gradient bucket takes the tree (the ring's latency alone is 39 ms); at 4 nodes and 64 MiB, the ring."""
    big = Cluster(Hardware.preset("a100-sxm-80gb"), nodes=2048, devices_per_node=8)
    mesh = big.mesh("m", (2048, 8), ("dp", "tp"))
    B = 25 * MiB
    e = CommEvent("all_reduce", ("dp",), 2 * 2047 * B // 2048, 2048)
    sent = 2 * 2047 * B // 2048
    ring = 2 * 2047 * NET_LAT + sent / NET_BW
    tree = 2 * 11 * 50e-6 + sent / (NET_BW * 0.9)
    assert tree < ring and event_time(e, big, mesh) == pytest.approx(tree)
    B = 64 * MiB
    e = CommEvent("all_reduce", ("dp",), 2 * 3 * B // 4, 4)
    ring = 2 * 3 * NET_LAT + (2 * 3 * B // 4) / NET_BW
    assert event_time(e, CL, DP_TP) == pytest.approx(ring)  # the tree's 0.9 of the bandwidth loses here
    slow = Cluster(Hardware.preset("a100-sxm-80gb").replace(tree_latency=1.0), nodes=2048, devices_per_node=8)
    assert event_time(CommEvent("all_reduce", ("dp",), sent, 2048), slow, mesh) > 0.039  # overridable: ring again
