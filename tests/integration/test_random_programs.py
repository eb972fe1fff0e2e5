"""Random op chains with random shardings and with_sharding constraints, against numpy."""

import numpy as np
from hypothesis import given, settings

import nabla as nb
from nabla.testing import assert_sharded_allclose, examples, programs


@given(programs(max_ops=6))
def test_random_programs_equal_numpy(prog):
    got = prog.run(nb)
    with np.errstate(all="ignore"):
        want = prog.run(np)
    assert_sharded_allclose(got, np.asarray(want, dtype=got.dtype), rtol=1e-4, atol=1e-4)


@settings(max_examples=examples(15))  # thorough: 3,333
@given(programs(max_ops=4))
def test_abstract_programs_log_the_same_collectives(prog):
    """The same chain on nb.abstract inputs plans exactly the communication of the real run."""
    from nabla.tensor import Tensor
    with nb.comm_log() as real:
        prog.run(nb)
    abstract_inputs = [(Tensor(None, t.sharding, t.shape, t.dtype), v) for t, v in prog.inputs]
    prog_abs = type(prog)(prog.mesh, abstract_inputs, prog.steps)
    with nb.comm_log() as planned:
        out = prog_abs.run(nb)
    assert out.is_abstract
    assert [(e.kind, e.axes, e.bytes) for e in planned.events] == [(e.kind, e.axes, e.bytes) for e in real.events]
