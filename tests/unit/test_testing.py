import numpy as np
import pytest
from hypothesis import given

import nabla as nb
from nabla import DeviceMesh
from nabla.testing import assert_comm, assert_sharded_allclose, meshes, programs, sharded_arrays

MESH = DeviceMesh("m", (2,), ("x",))


def test_assert_sharded_allclose_catches_a_wrong_block():
    t = nb.tensor(np.arange(4.0)).shard(MESH, ["x"])
    assert_sharded_allclose(t, np.arange(4.0))
    with pytest.raises(AssertionError):
        assert_sharded_allclose(t, np.arange(4.0) + 1e-3)
    # corrupt device 1's block only: the global check would pass through assemble, the block check must not
    data = t._data.copy()
    data[1, 0] = 99.0
    bad = nb.Tensor(data, t.sharding, t.shape, t.dtype)
    with pytest.raises(AssertionError):
        assert_sharded_allclose(bad, np.arange(4.0))


def test_assert_comm_is_exact():
    t = nb.tensor(np.arange(4.0)).shard(MESH, ["x"])
    with nb.comm_log() as log:
        t.with_sharding(MESH, [None])
    assert_comm(log, all_gather=1)
    with pytest.raises(AssertionError):
        assert_comm(log)
    with pytest.raises(AssertionError, match="unknown collective kind"):
        assert_comm(log, allgather=1)


@given(meshes())
def test_meshes_strategy(mesh):
    assert 1 <= mesh.ndim <= 3 and mesh.size <= 16 and sorted(mesh.devices) == list(range(mesh.size))


@given(sharded_arrays(mesh=MESH, shape=(3, 2)))
def test_sharded_arrays_strategy(pair):
    t, v = pair
    assert t.shape == (3, 2) and t.mesh == MESH
    assert_sharded_allclose(t, v, rtol=0, atol=0)


@given(programs(mesh=MESH, max_ops=3))
def test_programs_strategy_runs_on_both(prog):
    assert isinstance(prog.run(nb), nb.Tensor)
    assert 1 <= len(prog.steps) <= 3


def test_programs_docstring_example_runs():
    """The example in ``programs``' docstring is a working property test (run as doctest runs it)."""
    import doctest
    from nabla import testing
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(testing.programs, "programs", globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=0, attempted=6)


def test_slow_properties_scale_with_the_loaded_profile():
    """A slow property keeps its short count under CI and takes a third of a long profile's (thorough: 3,333),
    where a fixed ``@settings(max_examples=n)`` would pin it under every profile."""
    from hypothesis import settings
    from nabla.testing import examples
    current = settings._current_profile
    assert settings().max_examples <= 100 and examples(25) == 25
    settings.register_profile("long-for-this-test", max_examples=10_000)
    settings.load_profile("long-for-this-test")
    try:
        assert examples(25) == 3_333 and examples(60, 1) == 10_000 and examples(5_000) == 5_000
    finally:
        settings.load_profile(current)
    assert settings().max_examples <= 100
