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


# ---- bad arguments: ShardingError naming the argument, never TypeError / OverflowError --------------

import itertools  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

import nabla as nb  # noqa: E402
from nabla.mesh import MAX_DATA_DEVICES, MAX_DEVICES  # noqa: E402


@pytest.mark.parametrize("args, kwargs, words", [
    (("m", None, ("x",)), {}, ["shape", "None"]),
    (("m", "ab", ("x", "y")), {}, ["shape", "'ab'"]),
    (("m", {2: 1}, ("x",)), {}, ["shape"]),
    (("m", (2,), ("x",)), {"devices": 5}, ["devices", "5"]),
    (("m", (2,), ("x",)), {"devices": {0, 1}}, ["devices", "set"]),
    (("m", (2,), ("x",)), {"devices": [0, 2**63]}, ["device id 9223372036854775808", "[0, 2**63)"]),
    (("m", (2,), ("x",)), {"devices": [-1, 0]}, ["device id -1", "[0, 2**63)"]),
    (("m", (2,), ("x",)), {"devices": [0.0, 1.0]}, ["devices must be ints", "0.0"]),
    (("m", (2,), ("x",)), {"devices": itertools.count()}, ["needs 2 devices"]),
    (("m", (2,), ("x",)), {"devices": [0, True]}, ["devices must be ints", "True"]),
    (("m", (2**70,), ("x",)), {}, ["more than 1,048,576 devices"]),
    (("m", (10**6, 10**6), ("x", "y")), {}, ["more than 1,048,576 devices"]),
    (("m", (10**5000,), ("x",)), {}, ["more than 1,048,576 devices", "bits"]),
    (("m", (2.0,), ("x",)), {}, ["axis 'x' has size 2.0"]),
    (("m", (True,), ("x",)), {}, ["axis 'x' has size True"]),
    (("m", (2,), 5), {}, ["axis_names", "5"]),
    (("m", (2,), (5,)), {}, ["axis name 5"]),
    (("m", (2,), ("x:y",)), {}, ["axis name 'x:y'"]),
    ((5, (2,), ("x",)), {}, ["name must be a non-empty str", "5"]),
    (("m", itertools.repeat(1), ("x",)), {}, ["shape has more than 32 entries"]),
])
def test_bad_mesh_arguments_name_the_argument(args, kwargs, words):
    """Regression: these raised TypeError, OverflowError or MemoryError (or hung)."""
    with pytest.raises(ShardingError) as e:
        DeviceMesh(*args, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_an_int_shape_is_a_1d_mesh():
    """numpy's habit (np.zeros(8)): one int is a 1-D shape, one str names its one axis."""
    m = DeviceMesh("m", (8,), ("a",))
    assert DeviceMesh("m", 8, ("a",)) == m
    assert DeviceMesh("m", 8, "a") == m
    assert DeviceMesh("m", np.int64(8), ["a"]) == m
    assert DeviceMesh("m", np.array([2, 4]), ["a", "b"]) == DeviceMesh("m", (2, 4), ("a", "b"))
    assert DeviceMesh("m", 4, "a", devices=range(4)) == DeviceMesh("m", 4, "a")


def test_devices_may_be_an_array_of_the_mesh_shape():
    grid = np.array([[3, 2], [1, 0]])
    assert DeviceMesh("m", (2, 2), ("x", "y"), devices=grid).devices == (3, 2, 1, 0)
    with pytest.raises(ShardingError, match=r"devices array has shape \(4, 1\)"):
        DeviceMesh("m", (2, 2), ("x", "y"), devices=grid.reshape(4, 1))


def test_largest_mesh_builds_and_duplicates_are_found():
    """(How fast this is belongs to benchmarks/; here: the largest mesh holding data is accepted, a repeat refused,
    a mesh past it plans without data but takes none, and one past MAX_DEVICES is refused.)"""
    n = MAX_DATA_DEVICES
    m = DeviceMesh("big", (256, n // 256), ("x", "y"))
    assert m.coords(n - 1) == (255, n // 256 - 1)
    with pytest.raises(ShardingError, match=r"repeated: \[0\]"):
        DeviceMesh("big", (n,), ("x",), devices=[0] * 2 + list(range(2, n + 1))[:n - 2])
    huge = DeviceMesh("huge", (2, n), ("dp", "tp"))  # 131,072 devices: plans, abstractly
    with nb.comm_log() as log:
        nb.abstract((8, n * 4)).shard(huge, ["dp", "tp"]).with_sharding(huge, ["dp", None])
    assert [(e.kind, e.bytes) for e in log.events] == [("all_gather", (n - 1) * 4 * 4 * 4)]
    with pytest.raises(ShardingError, match="a mesh holding data has at most 65,536"):
        nb.ones((4, 4)).shard(huge, [None, None])
    with pytest.raises(ShardingError, match="more than 1,048,576 devices"):
        DeviceMesh("too", (MAX_DEVICES + 1,), ("x",))


def test_size_one_sub_axes_are_refused_and_overlap_is_symmetric():
    m = DeviceMesh("c", (4,), ("x",))
    with pytest.raises(ShardingError, match=r"sub-axis 'x:\(2\)1' has size 1"):
        m.axis_ref("x:(2)1")
    with pytest.raises(ShardingError, match="far past the axis size"):
        m.axis_ref("x:(" + "9" * 5000 + ")2")
    with pytest.raises(ShardingError, match="an axis must be a str"):
        m.axis_ref(["x"])
    a, b = AxisRef("x", 2, 1, 4), AxisRef("x", 2, 2, 4)
    assert a.overlaps(b) == b.overlaps(a)
    one = DeviceMesh("c", (1, 4), ("x", "y"))
    assert one.axis_ref("x:(1)1") == one.axis_ref("x") and one.axis_ref("x").overlaps(one.axis_ref("x"))


def test_device_at_refuses_bad_coords():
    m = DeviceMesh("c", (2, 2), ("x", "y"))
    for bad in [(2, 0), (0,), (0.0, 1), "ab", 5]:
        with pytest.raises(ShardingError, match="coords"):
            m.device_at(bad)


# ---- fuzzing: arbitrary Python values give a mesh or a ShardingError, nothing else -----------------

def anything():
    """Arbitrary Python values, small enough to build: scalars of every kind, huge ints, and nests of them."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                        st.complex_numbers(), st.text(max_size=6), st.binary(max_size=4),
                        st.sampled_from(["x", "y", "z", "x:(1)2", "y:(2)2", "q"]), st.integers(0, 8),
                        st.integers(0, 8).map(np.int64), st.just(np.float32(2.0)))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids),
                                                        st.lists(kids, max_size=3).map(tuple),
                                                        st.frozensets(st.integers(0, 8), max_size=3),
                                                        st.dictionaries(st.text(max_size=2), kids, max_size=2)),
                        max_leaves=12)


@given(name=st.one_of(st.just("m"), anything()), shape=anything(), axis_names=anything(),
       devices=st.one_of(st.none(), anything(), st.lists(st.integers(-2, 20), max_size=20)))
def test_fuzz_device_mesh_takes_anything(name, shape, axis_names, devices):
    try:
        m = DeviceMesh(name, shape, axis_names, devices)
    except ShardingError:
        return
    assert 1 <= m.size <= MAX_DEVICES and len(set(m.devices)) == m.size == len(m.devices)
    assert all(m.device_at(m.coords(d)) == d for d in m.devices)
    assert m == DeviceMesh(m.name, m.shape, m.axis_names, m.devices) and repr(m)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       names=st.lists(st.sampled_from("xyzw"), min_size=1, max_size=3, unique=True),
       devices=st.one_of(st.none(), st.permutations(range(8)), st.lists(st.integers(-1, 300), max_size=30)))
def test_fuzz_device_mesh_near_valid(shape, names, devices):
    try:
        m = DeviceMesh("m", shape, names, devices)
    except ShardingError:
        return
    assert m.shape == tuple(shape) and m.axis_names == tuple(names)
