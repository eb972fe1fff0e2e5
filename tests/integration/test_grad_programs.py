"""Random programs (nabla.testing.programs) differentiated on random shardings, with respect to every input,
equal the gradients of the same program run on unsharded tensors (the op-by-op gradients themselves are checked
against jax.grad in test_grad_sweep)."""

import numpy as np
from hypothesis import given, settings

import nabla as nb
from nabla.testing import examples, programs


def _with_inputs(prog, *xs):
    """Run ``prog`` on nabla with ``xs`` in place of its inputs."""
    saved = list(prog.inputs)
    prog.inputs[:] = [(x, v) for x, (_, v) in zip(xs, saved)]
    try:
        return prog.run(nb)
    finally:
        prog.inputs[:] = saved


@settings(max_examples=examples(40))
@given(programs(max_ops=5))
def test_gradients_of_random_programs_equal_the_unsharded_gradients(prog):
    out = prog.run(np)
    if np.asarray(out).dtype.kind != "f":
        return
    w = np.random.default_rng(0).standard_normal(np.shape(out)).astype(np.float32)
    inputs = [t for t, _ in prog.inputs]
    nums = tuple(range(len(inputs)))
    assert len(inputs) == 2

    def loss(x, o):
        return (_with_inputs(prog, x, o) * w).sum()

    def mixed(x, o):  # the chains rarely use their second input: make every one depend on it
        return (_with_inputs(prog, x * o, o) * w).sum()

    for f in (loss, mixed):
        grads = nb.grad(f, argnums=nums)(*inputs)
        want = nb.grad(f, argnums=nums)(*(nb.tensor(v) for _, v in prog.inputs))
        _check(grads, inputs, want, f"{f.__name__} {prog!r}")


def _check(grads, inputs, want, name):
    for i, (g, t, wg) in enumerate(zip(grads, inputs, want)):
        what = f"input {i} of {name}"
        assert g.shape == t.shape and g.dtype == t.dtype, what
        assert g.sharding.layout().dim_specs == t.sharding.layout().dim_specs, what
        assert g.sharding.partial_axes == (), what
        np.testing.assert_allclose(g.numpy(), wg.numpy(), rtol=2e-3, atol=2e-3, err_msg=what)
