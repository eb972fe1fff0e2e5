"""The rule check: for every op, lay the operands out exactly as propagation proposes, run the op,
and compare with numpy. Proposed layouts must need no data movement beyond what the op itself implies:
the cross-device max/min of a sharded max or min reduction, and, for a cut or joined dim that keeps its
sharding (slice, concatenate: Shardy's permutation factors), a collective_permute of the elements that
change owner. Nothing may be gathered, and every device must hold numpy's value."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import nabla as nb
from nabla import executor, ops
from nabla.propagation import current_strategy, propagate
from nabla.testing import assert_sharded_allclose, meshes, specs

# name -> (OpDef, params, shapes builder from a base 2-D shape (m, n), numpy reference)
CASES = {
    "add": (ops._BINARY["add"], (), lambda m, n: [(m, n), (m, n)], np.add),
    "multiply_bcast": (ops._BINARY["multiply"], (), lambda m, n: [(m, n), (1, n)], np.multiply),
    "maximum": (ops._BINARY["maximum"], (), lambda m, n: [(m, n), (m, n)], np.maximum),
    "exp": (ops._UNARY["exp"], (), lambda m, n: [(m, n)], np.exp),
    "matmul": (ops._MATMUL, (), lambda m, n: [(m, n), (n, 3)], np.matmul),
    "einsum": (ops._EINSUM, ("ij,kj->ik",), lambda m, n: [(m, n), (4, n)], lambda a, b: np.einsum("ij,kj->ik", a, b)),
    "sum0": (ops._SUM, ((0,), False), lambda m, n: [(m, n)], lambda a: a.sum(0)),
    "max1": (ops._MAX, ((1,), True), lambda m, n: [(m, n)], lambda a: a.max(1, keepdims=True)),
    "min0": (ops._MIN, ((0,), False), lambda m, n: [(m, n)], lambda a: a.min(0)),
    "argmax1": (ops._ARGMAX, (1,), lambda m, n: [(m, n)], lambda a: a.argmax(1)),
    "softmax0": (ops._SOFTMAX, (0,), lambda m, n: [(m, n)],
                 lambda a: np.exp(a - a.max(0)) / np.exp(a - a.max(0)).sum(0)),
    "transpose": (ops._TRANSPOSE, ((1, 0),), lambda m, n: [(m, n)], lambda a: a.T),
    "reshape_merge": (ops._RESHAPE, "merge", lambda m, n: [(m, n)], lambda a: a.reshape(-1)),
    "concatenate": (ops._CONCAT, (1,), lambda m, n: [(m, n), (m, 2)], lambda a, b: np.concatenate([a, b], 1)),
    "getitem": (ops._INDEX, ((("full",), ("slice", 0, 1, 1)),), lambda m, n: [(m, n)], lambda a: a[:, 0:1]),
}


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(CASES)))
    mesh = draw(meshes(max_devices=8))
    m, n = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    op, params, shapes_of, ref = CASES[name]
    shapes = shapes_of(m, n)
    if params == "merge":
        params = ((m * n,),)
    in_specs = [draw(specs(mesh, s, partial=False)) for s in shapes]
    seed = draw(st.integers(0, 100))
    return name, mesh, op, params, shapes, in_specs, ref, seed


@given(cases())
def test_proposed_layouts_compute_numpy_without_moving_data(case):
    name, mesh, op, params, shapes, in_specs, ref, seed = case
    rule = op.rule(tuple(shapes), *params)
    decision = propagate(rule, tuple(in_specs), mesh, current_strategy())
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    placed = [nb.tensor(v).shard(mesh, t.dim_specs) for v, t in zip(values, decision.operands)]
    what = f"{name} on shapes {shapes} with specs {in_specs}: proposed {list(decision.operands)} -> {decision.result}"
    with nb.comm_log() as log:
        out = executor.run(op, [ops._arg(t, name, i) for i, t in enumerate(placed)], params, nb.Tensor)
    if name in ("max1", "min0"):  # one all_reduce of the reduced block, or the planner's cheaper split of it
        allowed = {"all_reduce", "reduce_scatter", "all_gather"}  # (reduce_scatter, all_reduce, all_gather)
        ring = 2 * max(b.nbytes for b in out.shards.values())  # a ring all_reduce: 2 (k - 1) / k of the block
        assert log.total_bytes <= ring + len(log.events), f"{what}: {log.events} sends more than {ring} B"
    else:
        allowed = {"collective_permute"} if name in ("concatenate", "getitem") else set()
    assert set(log.counts) <= allowed, f"{what}: moved data {log.counts}"
    assert out.sharding.layout() == decision.result.layout() or name in ("max1", "min0"), what
    try:
        assert_sharded_allclose(out, ref(*values), rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
