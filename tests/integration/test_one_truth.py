"""One recorded program, read by everything: for random programs (random meshes, device orders, specs, partial
and uneven inputs, float dtypes, with and without gradients), the eager comm log, the log of the same program on
``nb.abstract`` inputs, ``nb.explain``'s moves and ``nb.jit``'s recorded steps list the same moves (kind, mesh
axes, bytes per device, in order); ``nb.jit``'s compiled comm log is what is left after its rewrites (each
removed move listed with its reason); and the compiled HLO (read with the XLA harness) holds exactly that log."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")

import nabla as nb  # noqa: E402
from nabla.debug import explain_steps  # noqa: E402
from nabla.tensor import Tensor  # noqa: E402
from nabla.testing import examples, programs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jit_check import assert_hlo_is_the_log  # noqa: E402

if len(jax.devices()) < 8:
    pytest.skip("needs 8 jax devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set in conftest)",
                allow_module_level=True)


def _moves(events) -> list[tuple]:
    return [(e.kind, tuple(e.axes), e.bytes) for e in events]


def _function(prog, dtype, grad: bool):
    """The program as a function of its two inputs (cast to ``dtype``); with ``grad``, the gradient of a weighted
    sum of its result with respect to both."""
    def run(x, o):
        x, o = x.astype(dtype), o.astype(dtype)
        for _, step in prog.steps:
            x = step(nb, x, [x, o])
        return x

    if not grad:
        return run
    shape = np.shape(prog.run(np))
    w = np.random.default_rng(0).standard_normal(shape).astype(dtype)

    def loss(x, o):
        return (run(x * o, o) * w).sum()  # every input feeds the result
    return nb.grad(loss, argnums=(0, 1))


@settings(max_examples=examples(30), derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(max_ops=5), st.sampled_from(["float32", "float64"]), st.booleans())
def test_eager_abstract_explain_and_jit_read_one_recorded_program(prog, dtype, grad):
    with np.errstate(all="ignore"):
        ref = np.asarray(prog.run(np))
    if grad and (ref.dtype.kind != "f" or not np.all(np.isfinite(ref))):
        grad = False
    fn = _function(prog, np.dtype(dtype), grad)
    args = [t for t, _ in prog.inputs]
    with np.errstate(all="ignore"), nb.comm_log() as eager:
        fn(*args)
    want = _moves(eager.events)

    abstract = [Tensor(None, t.sharding, t.shape, t.dtype) for t in args]
    with nb.comm_log() as planned:
        fn(*abstract)
    assert _moves(planned.events) == want

    with np.errstate(all="ignore"):
        steps, log, *_ = explain_steps(fn, tuple(args), {})
    assert [m for s in steps for m in _moves(e for e, _ in s.events)] == want
    assert _moves(log.events) == want

    lowered = nb.jit(fn).lower(*args)
    assert _moves(lowered.recorded.events) == want
    assert [m for s in lowered.steps for m in _moves(s.events)] == want
    kept, removed = _moves(lowered.comm_log.events), _moves(r.event for r in lowered.comm_log.removed)
    assert sorted(kept + removed) == sorted(want)
    assert {r.reason for r in lowered.comm_log.removed} <= {"repeated", "duplicate", "dead", "folded"}
    assert_hlo_is_the_log(lowered)
