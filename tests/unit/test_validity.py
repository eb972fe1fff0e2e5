"""The ONNX validity checker (seed 001) on hand-made shardings; the engine is checked against it in
test_propagation.py."""

import pytest

import nabla as nb
from nabla import DeviceMesh, ShardingSpec
from nabla import validity as V

M = DeviceMesh("m", (2, 4), ("x", "y"))


def S(*dims, **kw):
    return ShardingSpec(M, dims, **kw)


def test_checker_rejects_bad_shardings():
    with pytest.raises(nb.ShardingError, match="sharded differently|output dim"):
        V.check_broadcast([S("x", None), S(None, "x")], [(8, 8), (8, 8)], S("x", None), (8, 8))
    with pytest.raises(nb.ShardingError, match="broadcast"):
        V.check_broadcast([S("x", None), S("y", None)], [(8, 8), (1, 8)], S("x", None), (8, 8))
    with pytest.raises(nb.ShardingError, match="contracted dims differ"):
        V.check_matmul(S(None, "x"), S(None, None), S(None, None), [(8, 8), (8, 8)])
    with pytest.raises(nb.ShardingError, match="partial over"):
        V.check_reduction(S("x", None), (8, 8), (1,), False, S("x", partial_axes=["y"]))
    assert V.valid(V.check_unary, S("x", None), S("x", None))
    assert not V.valid(V.check_unary, S("x", None), S("y", None))



def test_broadcast_composition_by_device_sets():
    # [M,1] sharded over x and [1,N] over y compose into an [M,N] output on the intersection of devices
    V.check_broadcast([S("x", None), S(None, "y")], [(4, 1), (1, 8)], S("x", "y"), (4, 8))
    # an output split more finely than any device holds its inputs is rejected
    with pytest.raises(nb.ShardingError):
        V.check_broadcast([S("x", None), S(None, None)], [(4, 8), (4, 8)], S(("x", "y"), None), (4, 8))


def test_matmul_and_reduction_accept_the_partial_extension():
    assert V.valid(V.check_matmul, S(None, "x"), S("x", None), S(None, None, partial_axes=["x"]), [(8, 8), (8, 8)])
    assert V.valid(V.check_reduction, S("x", "y"), (8, 8), (1,), False, ShardingSpec(M, ["x"], partial_axes=["y"]))
    assert V.valid(V.check_reduction, S("x", "y"), (8, 8), (1,), True, S("x", None))
    assert not V.valid(V.check_reduction, S("x", "y"), (8, 8), (1,), True, S("x", "y"))


def test_partial_axes_made_of_sub_axis_pieces():
    # found by the thorough profile: reducing dims sharded x:(1)2 and x:(2)2 leaves a sum partial over x
    m = DeviceMesh("m", (4, 1), ("x", "y"))
    inp = ShardingSpec(m, ["x:(1)2", "y", "x:(2)2"])
    V.check_reduction(inp, (2, 1, 2), (0, 2), False, ShardingSpec(m, ["y"], partial_axes=["x"]))
    with pytest.raises(nb.ShardingError, match="partial over"):
        V.check_reduction(ShardingSpec(m, ["x:(1)2", "y", None]), (2, 1, 2), (0, 2), False,
                          ShardingSpec(m, ["y"], partial_axes=["x"]))
