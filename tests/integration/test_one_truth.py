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
from nabla import program, reshard  # noqa: E402
from nabla.debug import explain_steps  # noqa: E402
from nabla.jit import program as P  # noqa: E402
from nabla.reshard import search  # noqa: E402
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


# ---- what the thorough run (3,333 programs) found, kept as cases ----------------------------------------------

M412 = nb.DeviceMesh("m", (4, 1, 2), ("x", "y", "z"))


def _rand(seed, shape=(5, 3, 6)):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def test_a_cotangent_used_twice_is_gathered_as_often_in_jit_as_in_eager():
    """Found by the thorough run: the gradient of (reshape(x * o, (2, 3)) -> -, -, exp) * w summed, x and o of 6
    elements on x=4 (padded): the cotangent reaching x * o feeds both products' backward. Eager gathers it for each
    (x:(1)2, 12 B, twice: an untraced value keeps no gathered copy); the jit trace, which links the backward
    pass's values to compile them, kept the first gather on the cotangent and reused it. Such links are shadows
    (``trace.SHADOW``): what eager does not trace keeps no copy there either, and the jit program's rewrites
    remove the repeated gather (as XLA's CSE would)."""
    mesh = nb.DeviceMesh("m", (4, 1), ("x", "y"))
    x, o = (nb.tensor(_rand(s, (6,))).shard(mesh, [("x", "y")]) for s in (3, 4))
    w = _rand(5, (2, 3))

    def fn(x, o):
        return nb.grad(lambda x, o: (nb.exp(-(-nb.reshape(x * o, (2, 3)))) * w).sum(), argnums=(0, 1))(x, o)

    with nb.comm_log() as eager:
        fn(x, o)
    lowered = nb.jit(fn).lower(x, o)
    assert _moves(lowered.recorded.events) == _moves(eager.events)
    assert [(r.reason, r.event.kind, r.event.bytes) for r in lowered.comm_log.removed] == \
        [("repeated", "all_gather", 12)]  # the cotangent's second gather (the 24 B ones gather x and o)
    assert_hlo_is_the_log(lowered)


def test_astype_to_its_own_dtype_keeps_a_pending_sum_pending():
    """x.astype(x.dtype) of a value partial over z made the sum there (an all_reduce of 120 B) before a
    with_sharding that cuts the summed dim over z anyway: XLA turned all_reduce + slice into a reduce_scatter of
    60 B. Converting nothing sums nothing: the with_sharding's reduce_scatter, the log and the HLO agree."""
    x = nb.tensor(_rand(0)).shard(M412, [["y"], [], ["x"]], partial_axes=["z"])

    def fn(x):
        return -nb.expand_dims(x.astype("float32"), 0).with_sharding(M412, [["y"], [], [], ["x", "z"]])

    with nb.comm_log() as log:
        fn(x)
    assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("reduce_scatter", ("z",), 60)]
    assert_hlo_is_the_log(nb.jit(fn).lower(x))


def test_permutes_over_sub_axes_and_their_transposes_match_the_hlo():
    """A gradient through a with_sharding that reorders x's sub-axes on a dim (x:(2)2 before x:(1)2) with z
    replicated: permutes over x and over (x, z) of the same bytes; each HLO permute is matched to a log event
    whose groups hold its pairs (a perfect matching, not a greedy one)."""
    x = nb.tensor(_rand(1)).shard(M412, [nb.DimSpec([], is_open=True), [], nb.DimSpec(["x"], is_open=True)],
                                  partial_axes=["y", "z"])
    o = nb.tensor(_rand(2)).shard(M412, [[], nb.DimSpec(["z", "y"], is_open=True), nb.DimSpec([], is_open=True)])
    w = np.random.default_rng(0).standard_normal((1, 3, 6))

    def loss(x, o):
        y = (x * o).astype("float64").sum(axis=0)
        y = y.with_sharding(M412, [["x:(2)2", "x:(1)2"], ["y"]], replicated_axes=["z"])
        return (nb.expand_dims(nb.reshape(nb.transpose(y, (0, 1)), (3, 6)), 0) * w).sum()

    fn = nb.grad(loss, argnums=(0, 1))
    with nb.comm_log() as log:
        gx, go = fn(x, o)
    assert {e.axes for e in log.events if e.kind == "collective_permute"} == {("x",), ("x", "z")}
    xv, ov = x.numpy(), o.numpy()
    np.testing.assert_allclose(gx.numpy(), ov * w[0], rtol=1e-5)
    np.testing.assert_allclose(go.numpy(), xv * w[0], rtol=1e-5)
    assert_hlo_is_the_log(nb.jit(fn).lower(x, o))


@pytest.mark.parametrize("shape", [(4, 1), (2, 4)])
def test_a_move_already_made_on_the_way_to_another_is_made_once(shape):
    """o is gathered to [{}, {}] in the forward pass and to [{"y"}, {}] in the backward. With y of one device the
    two are one placement; with y of 4, the forward's gather over x then y passes through [{"y"}, {}]. Either
    way nb.jit makes the backward's move once (logged as removed, "repeated"), as XLA's CSE does."""
    m = nb.DeviceMesh("m", shape, ("x", "y"))
    x = nb.tensor(np.array([[0.125], [-0.25]], np.float32)).shard(m, [["x", "y"], []])
    o = nb.tensor(np.array([[0.625], [0.125]], np.float32)).shard(m, [["y"], ["x"]])
    w = np.array([[0.5], [-1.5]], np.float32)
    fn = nb.grad(lambda x, o: (nb.exp(x * o) * w).sum(), argnums=(0, 1))
    lowered = nb.jit(fn).lower(x, o)
    assert [(r.event.kind, r.reason) for r in lowered.comm_log.removed] == [("all_gather", "repeated")]
    assert_hlo_is_the_log(lowered)
    gx, go = nb.jit(fn)(x, o)
    e = np.exp(x.numpy() * o.numpy()) * w
    np.testing.assert_allclose(gx.numpy(), e * o.numpy(), rtol=1e-6)
    np.testing.assert_allclose(go.numpy(), e * x.numpy(), rtol=1e-6)



def test_jit_builds_its_instructions_from_the_recorded_plans_without_planning(monkeypatch):
    """The forward's gather of o over x then y (the test above, y of 4) is split into its hops from the plan it
    ran (``Plan.hops``, the planner's): building the instructions calls no planner, and the backward's move to
    the layout the first hop reaches is still made once."""
    m = nb.DeviceMesh("m", (2, 4), ("x", "y"))
    x = nb.tensor(np.array([[0.125], [-0.25]], np.float32)).shard(m, [["x", "y"], []])
    o = nb.tensor(np.array([[0.625], [0.125]], np.float32)).shard(m, [["y"], ["x"]])
    fn = nb.grad(lambda x, o: (nb.exp(x * o) * np.float32(0.5)).sum(), argnums=(0, 1))
    built, seen = P.instructions, []

    def no_planning(*a, **k):
        raise AssertionError("nb.jit planned a move while building its instructions")

    def instructions(steps):
        with monkeypatch.context() as mp:
            for mod, name in ((reshard, "plan"), (reshard, "_plan"), (search, "plan"), (search, "_plan"),
                              (program, "program_for")):
                mp.setattr(mod, name, no_planning)
            got = built(steps)
        seen.extend(got)
        return got

    monkeypatch.setattr(P, "instructions", instructions)
    lowered = nb.jit(fn).lower(x, o)
    hop = P.layout(nb.ShardingSpec(m, [["y"], []]))
    hops = [i for i in seen if i.kind == "move" and not i.plan.query]  # a hop's plan answers no query of its own
    assert [(i.writes[1] == hop, [e.axes for e in i.events]) for i in hops] == [(True, [("x",)]), (False, [("y",)])]
    assert [(r.event.kind, r.reason) for r in lowered.comm_log.removed] == [("all_gather", "repeated")]
    assert_hlo_is_the_log(lowered)
