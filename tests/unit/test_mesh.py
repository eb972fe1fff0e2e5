import pytest

from nabla import DeviceMesh, ShardingError
from nabla.mesh import AxisRef


def test_repr_shape_and_coords():
    m = DeviceMesh("cluster", (2, 4), ("dp", "tp"))
    assert repr(m) == '@cluster = <["dp"=2, "tp"=4]>'
    assert m.size == 8 and m.devices == tuple(range(8))
    assert m.axis_size("tp") == 4
    assert m.coords(6) == (1, 2)
    assert m.device_at((1, 2)) == 6


def test_custom_device_order_is_row_major():
    m = DeviceMesh("c", (2, 2), ("x", "y"), devices=[3, 1, 0, 2])
    assert m.coords(3) == (0, 0) and m.coords(1) == (0, 1) and m.coords(2) == (1, 1)
    assert "device_ids=[3, 1, 0, 2]" in repr(m)


def test_hashable_and_equal_by_value():
    a = DeviceMesh("c", (2, 4), ("x", "y"))
    b = DeviceMesh("c", [2, 4], ["x", "y"])
    c = DeviceMesh("c", (2, 4), ("x", "y"), devices=[7, 6, 5, 4, 3, 2, 1, 0])
    assert a == b and hash(a) == hash(b) and len({a, b, c}) == 2
    assert a != c


def test_sub_axes():
    m = DeviceMesh("c", (8,), ("x",))
    assert m.axis_ref("x:(1)2") == AxisRef("x", 1, 2, 8)
    assert m.axis_size("x:(2)4") == 4
    # on x=8, x:(2)4 is the minor quarter: device 5 (coord 5) sits at 5 % 4 = 1
    assert m.axis_ref("x:(2)4").coord(5) == 1
    assert m.axis_ref("x:(1)2").coord(5) == 1
    assert not m.axis_ref("x:(1)2").overlaps(m.axis_ref("x:(2)4"))
    assert m.axis_ref("x:(1)4").overlaps(m.axis_ref("x:(2)4"))
    assert m.axis_ref("x").overlaps(m.axis_ref("x:(4)2"))


@pytest.mark.parametrize("args, words", [
    (("c", (2, 0), ("x", "y")), ["axis 'y'", "size 0", ">= 1"]),
    (("c", (2,), ("x", "y")), ["1 axis sizes", "2 names"]),
    (("c", (2, 2), ("x", "x")), ["not distinct"]),
])
def test_bad_meshes(args, words):
    with pytest.raises(ShardingError) as e:
        DeviceMesh(*args)
    for w in words:
        assert w in str(e.value)


def test_bad_devices():
    with pytest.raises(ShardingError, match="needs 4 devices, got 3"):
        DeviceMesh("c", (2, 2), ("x", "y"), devices=[0, 1, 2])
    with pytest.raises(ShardingError, match=r"not distinct \(repeated: \[1\]\)"):
        DeviceMesh("c", (2, 2), ("x", "y"), devices=[0, 1, 1, 2])


def test_bad_axis_references():
    m = DeviceMesh("c", (6,), ("x",))
    with pytest.raises(ShardingError, match="unknown axis 'q'"):
        m.axis_ref("q")
    with pytest.raises(ShardingError, match=r"sub-axis 'x:\(2\)2' does not divide axis 'x' of size 6"):
        m.axis_ref("x:(2)2")
    with pytest.raises(ShardingError, match="not in the mesh"):
        m.coords(17)
