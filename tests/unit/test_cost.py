"""nb.CostModel: per-axis latency and bandwidth, used by the planner's choice and by the comm log's "est. us"."""

import numpy as np
import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingError, ShardingSpec
from nabla.cost import DEFAULT, current
from nabla.reshard import plan

MESH = DeviceMesh("m", (2, 4), ("dp", "tp"))


def test_defaults_and_per_axis_links():
    assert current() is DEFAULT and DEFAULT.link(["tp"]) == nb.AxisCost(5e-6, 25e9)
    slow = nb.CostModel(axes={"dp": (20e-6, 12.5e9)})
    assert slow.link(["tp"]) == nb.AxisCost(5e-6, 25e9)
    assert slow.link(["dp:(1)2", "tp"]) == nb.AxisCost(20e-6, 12.5e9)  # a sub-axis runs on its axis' link
    assert slow.time(2, 1000, ["dp"]) == 2 * 20e-6 + 1000 / 12.5e9
    assert slow == nb.CostModel(axes={"dp": nb.AxisCost(20e-6, 12.5e9)}) and hash(slow) == hash(
        nb.CostModel(axes={"dp": nb.AxisCost(20e-6, 12.5e9)}))
    assert "dp" in repr(slow)


@pytest.mark.parametrize("bad", [dict(bandwidth=0), dict(latency=-1), dict(latency="fast"),
                                 dict(axes={"dp": (1e-6, float("nan"))})])
def test_bad_costs_are_refused(bad):
    with pytest.raises(ShardingError, match="CostModel"):
        nb.CostModel(**bad)


def test_the_planner_avoids_a_slow_axis():
    """[tp, -] -> [dp, tp] on 16x16 float32: by default each device receives the two [4,8] pieces it lacks in
    two collective_permute rounds that cross dp (128 B); with dp 25x slower, one all_to_all over tp (192 B)."""
    src, dst = ShardingSpec(MESH, ["tp", None]), ShardingSpec(MESH, ["dp", "tp"])
    fast = plan((16, 16), 4, src, dst)
    assert [(e.kind, e.bytes) for e in fast.events] == [("collective_permute", 64), ("collective_permute", 64)]
    assert any("dp" in e.axes for e in fast.events)
    with nb.cost_model(nb.CostModel(axes={"dp": nb.AxisCost(20e-6, 1e9)})):
        slow = plan((16, 16), 4, src, dst)
    assert [(e.kind, e.axes, e.bytes) for e in slow.events] == [("all_to_all", ("tp",), 192)]


def test_comm_log_estimates_with_the_model_in_force():
    t = nb.tensor(np.ones((8, 8), np.float32)).shard(MESH, [None, None], partial_axes=["dp"])
    with nb.cost_model(nb.CostModel(axes={"dp": (1e-3, 1e9)})), nb.comm_log() as log:
        t.with_sharding(MESH, [None, None])
    # the slow dp link sums only the quarter each tp replica cut (64 B), then tp gathers the quarters
    e = next(e for e in log.events if e.kind == "all_reduce")
    assert e.axes == ("dp",) and e.bytes == 64
    assert e.cost == pytest.approx(2 * 1e-3 + 64 / 1e9)
    assert f"{e.cost * 1e6:,.1f}" in log.summary()


def test_cost_model_context_is_refused_for_other_values():
    with pytest.raises(ShardingError, match="expected a CostModel"):
        with nb.cost_model({"dp": 1}):
            pass
