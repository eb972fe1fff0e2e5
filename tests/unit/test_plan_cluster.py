"""nabla.plan.cluster: meshes over a cluster's devices and the link tier of collectives over their axes."""

from __future__ import annotations

import pytest

from nabla.errors import ShardingError
from nabla.mesh import DeviceMesh
from nabla.plan import Cluster, Hardware, Tier

HW = Hardware.preset("a100-sxm-80gb")
CL = Cluster(HW, nodes=4, devices_per_node=8)


def test_mesh_is_an_ordinary_device_mesh():
    m = CL.mesh("m", (4, 8), ("dp", "tp"))
    assert m == DeviceMesh("m", (4, 8), ("dp", "tp")) and hash(m) == hash(DeviceMesh("m", (4, 8), ("dp", "tp")))
    assert m.devices == tuple(range(32))
    assert [CL.node_of(d) for d in (0, 7, 8, 31)] == [0, 0, 1, 3]


def test_mesh_size_must_match_the_cluster():
    with pytest.raises(ShardingError, match=r"\(3, 8\) has 24 devices.*4 nodes x 8 devices = 32"):
        CL.mesh("m", (3, 8), ("dp", "tp"))


def test_tiers_on_dp_tp():
    m = CL.mesh("m", (4, 8), ("dp", "tp"))
    assert CL.tier(m, ["tp"]) == Tier("nvlink", 8, 1)  # devices 8i..8i+7: one node
    assert CL.tier(m, ["dp"]) == Tier("network", 1, 4)  # devices j, 8+j, 16+j, 24+j: four nodes
    assert CL.tier(m, ["dp", "tp"]) == Tier("hierarchical", 8, 4)


def test_an_axis_longer_than_a_node_is_hierarchical():
    m = CL.mesh("m", (2, 16), ("a", "b"))
    assert CL.tier(m, ["b"]) == Tier("hierarchical", 8, 2)  # b's 16 devices: 8 on each of 2 nodes
    assert CL.tier(m, ["a"]) == Tier("network", 1, 2)


def test_sub_axes():
    m = CL.mesh("m", (2, 16), ("a", "b"))
    # device = 16 a + c with c in 0..15, node = 2 a + c // 8: b's major half c // 8 changes node,
    # its minor eighth c % 8 does not
    assert CL.tier(m, ["b:(1)2"]) == Tier("network", 1, 2)
    assert CL.tier(m, ["b:(2)8"]) == Tier("nvlink", 8, 1)
    assert CL.tier(m, ["b:(2)4"]) == Tier("nvlink", 4, 1)
    assert CL.tier(m, ["a", "b:(1)2"]) == Tier("network", 1, 4)
    assert CL.tier(m, ["a", "b:(2)8"]) == Tier("hierarchical", 8, 2)


def test_no_axes_is_a_group_of_one():
    assert CL.tier(CL.mesh("m", (32,), ("x",)), []) == Tier("nvlink", 1, 1)


def test_uneven_groups_run_on_the_network():
    # a custom order that puts 3 of a 4-group on one node and 1 on another
    m = DeviceMesh("m", (8, 4), ("a", "b"), devices=[0, 1, 2, 8, 3, 4, 5, 9, 6, 7, 10, 11] + list(range(12, 32)))
    assert CL.tier(m, ["b"]) == Tier("network", 1, 4)


def test_bad_inputs_are_named():
    m = CL.mesh("m", (4, 8), ("dp", "tp"))
    with pytest.raises(ShardingError, match="unknown axis 'pp'"):
        CL.tier(m, ["pp"])
    with pytest.raises(ShardingError, match="device 63 but the cluster has devices 0..31"):
        CL.tier(DeviceMesh("big", (64,), ("x",)), ["x"])
    with pytest.raises(ShardingError, match="nodes must be an int >= 1, got 0"):
        Cluster(HW, nodes=0, devices_per_node=8)
    with pytest.raises(ShardingError, match="hardware must be a Hardware"):
        Cluster("a100", nodes=1, devices_per_node=8)
    with pytest.raises(ShardingError, match="device 40 is not in the cluster"):
        CL.node_of(40)
