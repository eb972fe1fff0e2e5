"""Shardy-style expectation tables: input specs -> merged factor shardings -> output and operand specs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import nabla as nb
from nabla import DeviceMesh, DimSpec, ShardingSpec
from nabla import rules as R
from nabla import validity as V
from nabla.propagation import AGGRESSIVE, BASIC, Opinion, project_dim, propagate, why
from nabla.testing import meshes, specs

M = DeviceMesh("m", (2, 4), ("x", "y"))
M3 = DeviceMesh("m3", (2, 2, 2), ("a", "b", "c"))


def S(*dims, mesh=M, **kw):
    return ShardingSpec(mesh, dims, **kw)


def names(decision):
    return [tuple(str(r) for r in f) for f in decision.factors]


MATMUL = R.matmul_rule((8, 8), (8, 8))

# (lhs, rhs, strategy) -> (factor axes m/k/n, lhs target, rhs target, result)
MATMUL_TABLE = [
    (S("x", None), S(None, "y"), BASIC, [("x",), (), ("y",)], S("x", None), S(None, "y"), '[{"x", ?}, {"y", ?}]'),
    (S(None, "x"), S("x", None), BASIC, [(), ("x",), ()], S(None, "x"), S("x", None), '[{?}, {?}], partial={"x"}'),
    # A[x|-] @ B[-|x] must not give C[x|x]: Shardy's basic propagation gives an axis two factors hold to
    # neither (basic_factor_propagation.cc, compatiblePrefixNoConflictsAcrossFactors)
    (S("x", None), S(None, "x"), BASIC, [(), (), ()], S(None, None), S(None, None), "[{?}, {?}]"),
    # ... while AGGRESSIVE gives it to one: the larger tensor's factor, then the lhs on a tie
    (S("x", None), S(None, "x"), AGGRESSIVE, [("x",), (), ()], S("x", None), S(None, None), '[{"x", ?}, {?}]'),
    # a closed replicated operand blocks under BASIC, not under AGGRESSIVE
    (S(None, "x"), S(None, None), BASIC, [(), (), ()], S(None, None), S(None, None), "[{?}, {?}]"),
    (S(None, "x"), S(None, None), AGGRESSIVE, [(), ("x",), ()], S(None, "x"), S("x", None),
     '[{?}, {?}], partial={"x"}'),
    (S(("x", "y"), None), S(None, None), BASIC, [("x", "y"), (), ()], S(("x", "y"), None), S(None, None),
     '[{"x", "y", ?}, {?}]'),
]


@pytest.mark.parametrize("a, b, strat, factors, ta, tb, result", MATMUL_TABLE)
def test_matmul_table(a, b, strat, factors, ta, tb, result):
    d = propagate(MATMUL, (a, b), M, strat)
    assert names(d) == factors
    assert d.operands[0].layout() == ta.layout() and d.operands[1].layout() == tb.layout()
    assert repr(d.result) == result


def test_plain_operands_are_open():
    d = propagate(MATMUL, (S(None, "x"), None), M, BASIC)
    assert names(d) == [(), ("x",), ()]
    assert repr(d.operands[1]) == '[{"x", ?}, {?}]'


EW = R.elementwise_rule(((8, 8), (8, 8)))


def test_basic_truncates_to_the_closed_prefix_aggressive_extends():
    a, b = S("x", None), S(("x", "y"), None)
    assert names(propagate(EW, (a, b), M, BASIC))[0] == ("x",)
    assert names(propagate(EW, (a, b), M, AGGRESSIVE))[0] == ("x", "y")
    # open dims may gain axes under BASIC too
    a_open = S(DimSpec(["x"], is_open=True), None)
    assert names(propagate(EW, (a_open, b), M, BASIC))[0] == ("x", "y")


def test_non_prefix_lists_propagate_nothing():
    d = propagate(EW, (S("x", None), S("y", None)), M, AGGRESSIVE)
    assert names(d)[0] == ()


def test_priorities_lower_wins():
    a = S(DimSpec(["x"], priority=1), None)
    b = S("y", None)
    assert names(propagate(EW, (a, b), M, BASIC))[0] == ("y",)
    assert names(propagate(EW, (S(DimSpec(["x"], priority=0), None), S(DimSpec(["y"], priority=2), None)),
                           M, BASIC))[0] == ("x",)


def test_aggressive_prefers_the_larger_tensor_between_conflicting_factors():
    r = R.matmul_rule((2, 8), (8, 64))
    a, b = S("x", None), S(None, "x")
    assert names(propagate(r, (a, b), M, BASIC)) == [(), (), ()]  # contested: neither
    assert names(propagate(r, (a, b), M, AGGRESSIVE)) == [(), (), ("x",)]  # b is larger


def test_aggressive_breaks_ties_by_sharding_only_in_elementwise_ops():
    """Shardy (aggressive_factor_propagation.cc: sort by source tensor size, then, for elementwise ops only, how
    sharded, then the source tensor's index): with tensors of one size, [-|x] + [(y,x)|-] gives "x" to the more
    sharded factor, while [x|-] @ [-|(y,x)] gives it to the lhs's factor and the rhs's keeps "y"."""
    add = propagate(EW, (S(None, "x"), S(("y", "x"), None)), M, AGGRESSIVE)
    assert names(add) == [("y", "x"), ()]
    dot = propagate(MATMUL, (S("x", None), S(None, ("y", "x"))), M, AGGRESSIVE)
    assert names(dot) == [("x",), (), ("y",)]


def test_aggressive_source_of_a_common_prefix_is_every_tensor_holding_it():
    """A factor whose lists diverge ([a,b] and [a,c]) gets their common prefix [a], and the tensors that hold it
    are its sources (Shardy): it ties with a factor wanting "a" from a third operand of the same size, and the
    earlier source tensor wins, the first operand's factor."""
    where = R.elementwise_rule(((8, 8), (8, 8), (8, 8)))
    o = lambda *axes: DimSpec(list(axes), is_open=True)  # noqa: E731
    d = propagate(where, (S(o("a", "b"), o(), mesh=M3), S(o("a", "c"), o(), mesh=M3), S(o(), o("a"), mesh=M3)),
                  M3, AGGRESSIVE)
    assert names(d) == [("a",), ()]


def test_aggressive_result_factors_beat_contracting_ones():
    """FSDP's x[dp, -] @ w[dp, -]: m keeps dp and w is gathered, as jax.jit does (api.md: measured with jax
    0.10.2, one all_gather of w); the contracting k only takes axes left over."""
    r = R.matmul_rule((16, 16), (16, 32))
    m4 = DeviceMesh("f", (4,), ("dp",))
    x, w = S("dp", None, mesh=m4), S("dp", None, mesh=m4)
    d = propagate(r, (x, w), m4, AGGRESSIVE)
    assert names(d) == [("dp",), (), ()]
    assert repr(d.result) == '[{"dp", ?}, {?}]' and d.operands[1].layout() == S(None, None, mesh=m4)


def test_explicitly_replicated_dims_are_closed():
    d = propagate(EW, (S("x", None), S(None, None)), M, BASIC)
    assert names(d)[0] == ()
    d = propagate(EW, (S("x", None), S(DimSpec([], is_open=True), None)), M, BASIC)
    assert names(d)[0] == ("x",)


def test_reserved_axes_are_never_used():
    d = propagate(EW, (S(("x", "y"), None), None), M, BASIC, reserved=("y",))
    assert names(d)[0] == ("x",)


def test_reshape_sub_axes():
    # 8 on [y] (y=4) -> (2, 4): y splits into y:(1)2 and y:(2)2
    r = R.reshape_rule((8,), (2, 4))
    d = propagate(r, (S("y"),), M, BASIC)
    assert repr(d.result) == '[{"y:(1)2", ?}, {"y:(2)2", ?}]'
    # and back: the sub-axes merge into y
    back = propagate(R.reshape_rule((2, 4), (8,)), (d.result,), M, BASIC)
    assert repr(back.result) == '[{"y", ?}]'


def test_reshape_split_that_does_not_divide_stops():
    r = R.reshape_rule((6,), (3, 2))
    d = propagate(r, (S("y"),), M, BASIC)  # y=4 divides neither 3 nor 6
    assert repr(d.result) == "[{?}, {?}]"


def test_reshape_uneven_major_factor_is_not_sharded():
    r = R.reshape_rule((5, 16), (80,))
    d = propagate(r, (S(DimSpec(["y"]), None),), M, BASIC)
    assert repr(d.result) == "[{?}]"


def test_reshape_merge_keeps_sharding():
    d = propagate(R.reshape_rule((8, 16), (128,)), (S("x", None),), M, BASIC)
    assert repr(d.result) == '[{"x", ?}]'
    d2 = propagate(R.reshape_rule((128,), (2, 64)), (d.result,), M, BASIC)
    assert repr(d2.result) == '[{"x", ?}, {?}]'


def test_project_dim_splits_axes_over_factors():
    refs = [M.axis_ref("y")]
    assert {f: [str(r) for r in v] for f, v in project_dim(refs, (0, 1), (2, 4)).items()} == \
        {0: ["y:(1)2"], 1: ["y:(2)2"]}


def test_replicate_factors_are_never_sharded():
    r = R.elementwise_rule(((8, 8),), (1,), "softmax")
    d = propagate(r, (S("x", "y"),), M, BASIC)
    assert repr(d.result) == '[{"x", ?}, {?}]'


def test_reduce_gives_partial():
    r = R.reduce_rule((8, 8), (1,), False)
    d = propagate(r, (S("x", "y"),), M, BASIC)
    assert repr(d.result) == '[{"x", ?}], partial={"y"}'


def test_propagation_is_cached():
    a, b = S("x", None), S(None, "y")
    assert propagate(MATMUL, (a, b), M, BASIC) is propagate(MATMUL, (a, b), M, BASIC)


def test_strategy_context():
    from nabla.propagation import current_strategy
    assert current_strategy() == AGGRESSIVE  # the default, as in JAX's Shardy pipeline
    with nb.strategy("basic"):
        assert current_strategy() == BASIC
    assert current_strategy() == AGGRESSIVE
    with pytest.raises(nb.ShardingError, match="unknown strategy"):
        with nb.strategy("greedy"):
            pass


# ---- the validity checker against the engine -----------------------------------------------------------

@st.composite
def _op_case(draw):
    mesh = draw(meshes(max_devices=8))
    kind = draw(st.sampled_from(["ew", "bcast", "matmul", "reduce", "unary"]))
    dim = st.integers(1, 6)
    if kind == "matmul":
        m, k, n = draw(dim), draw(dim), draw(dim)
        shapes = [(m, k), (k, n)]
    elif kind == "bcast":
        a, b = draw(dim), draw(dim)
        shapes = [(a, 1), (1, b)]
    elif kind == "reduce":
        shapes = [tuple(draw(st.lists(dim, min_size=1, max_size=3)))]
    else:
        s = tuple(draw(st.lists(dim, min_size=1, max_size=3)))
        shapes = [s, s] if kind == "ew" else [s]
    in_specs = tuple(draw(specs(mesh, s, partial=False)) for s in shapes)
    strat = draw(st.sampled_from([BASIC, AGGRESSIVE]))
    axes = tuple(sorted(draw(st.sets(st.integers(0, len(shapes[0]) - 1), min_size=1)))) if kind == "reduce" else ()
    return mesh, kind, shapes, in_specs, strat, axes


@given(_op_case())
def test_propagated_specs_are_valid(case):
    mesh, kind, shapes, in_specs, strat, axes = case
    if kind == "matmul":
        rule = R.matmul_rule(*shapes)
    elif kind == "reduce":
        rule = R.reduce_rule(shapes[0], axes, False)
    else:
        rule = R.elementwise_rule(tuple(shapes))
    d = propagate(rule, in_specs, mesh, strat)
    out_axes = [a for ds in d.result.dim_specs for a in ds.axes] + list(d.result.partial_axes)
    assert len(out_axes) == len(set(out_axes))
    out_shape = rule.result_shape
    if kind == "matmul":
        V.check_matmul(d.operands[0], d.operands[1], d.result, shapes)
    elif kind == "reduce":
        V.check_reduction(d.operands[0], shapes[0], axes, False, d.result)
    elif kind == "unary":
        V.check_unary(d.operands[0], d.result)
    else:
        V.check_broadcast(d.operands, shapes, d.result, out_shape)


# ---- one table per template: (rule, input specs, strategy) -> (factor axes, operand targets, result) -----

O = DimSpec([], is_open=True)
TEMPLATE_TABLE = [
    # elementwise, n-ary with broadcasting: a size-1 broadcast dim gets no factor sharding (ONNX)
    ("elementwise", R.elementwise_rule(((8, 1), (1, 8))), (S("x", None), S(None, "y")), BASIC,
     [("x",), ("y",)], ['[{"x"}, {}]', '[{}, {"y"}]'], '[{"x", ?}, {"y", ?}]'),
    ("elementwise 3-ary", R.elementwise_rule(((8, 8), (8,), (8, 8))), (S("x", O), S("y"), S(O, O)), BASIC,
     [("x",), ("y",)], ['[{"x"}, {"y"}]', '[{"y"}]', '[{"x"}, {"y"}]'], '[{"x", ?}, {"y", ?}]'),
    # reduce: the reduced factor sharded gives partial sums; keepdims leaves an unsharded size-1 dim
    ("reduce keepdims", R.reduce_rule((8, 8), (0,), True), (S("x", "y"),), BASIC,
     [("x",), ("y",)], ['[{"x"}, {"y"}]'], '[{?}, {"y", ?}], partial={"x"}'),
    ("reduce all", R.reduce_rule((8, 8), (0, 1), False), (S(("x", "y"), None),), BASIC,
     [("x", "y"), ()], ['[{"x", "y"}, {}]'], '[], partial={"x", "y"}'),
    # transpose: factors follow the permutation
    ("transpose", R.transpose_rule((4, 8, 2), (2, 0, 1)), (S("y", "x", None),), BASIC,
     [("y",), ("x",), ()], ['[{"y"}, {"x"}, {}]'], '[{?}, {"y", ?}, {"x", ?}]'),
    # reshape: a merge keeps the major dim's axes, and the minor dim's only when the major is whole on
    # them (here x=2 covers half of 4 rows, so y is dropped); a split yields sub-axes; coprime runs replicate
    ("reshape merge", R.reshape_rule((4, 8), (32,)), (S("x", "y"),), BASIC,
     [("x",), ()], ['[{"x"}, {}]'], '[{"x", ?}]'),
    ("reshape merge whole", R.reshape_rule((2, 8), (16,)), (S("x", "y"),), BASIC,
     [("x",), ("y",)], ['[{"x"}, {"y"}]'], '[{"x", "y", ?}]'),
    ("reshape split", R.reshape_rule((32,), (4, 8)), (S(("x", "y")),), BASIC,
     [("x", "y:(1)2"), ("y:(2)2",)], ['[{"x", "y"}]'], '[{"x", "y:(1)2", ?}, {"y:(2)2", ?}]'),
    ("reshape common major factor", R.reshape_rule((6, 4), (4, 6)), (S("x", "y"),), BASIC,
     [("x",), (), (), (), (), ()], ['[{"x"}, {}]'], '[{"x", ?}, {?}]'),
    ("reshape coprime", R.reshape_rule((3, 2), (2, 3)), (S("x", "y:(1)2"),), BASIC,
     [(), (), (), ()], ['[{}, {}]'], "[{?}, {?}]"),
    # concatenate: the joined dim is one window factor of every operand and the result (here the closed
    # replicated dim of the second operand keeps it unsharded under BASIC); the others pass through
    ("concatenate", R.concatenate_rule(((8, 2), (8, 6)), 1), (S("x", "y"), S(O, None)), BASIC,
     [("x",), ()], ['[{"x"}, {}]', '[{"x"}, {}]'], '[{"x", ?}, {?}]'),
    ("concatenate open", R.concatenate_rule(((8, 2), (8, 6)), 1), (S("x", "y"), S(O, O)), BASIC,
     [("x",), ("y",)], ['[{"x"}, {"y"}]', '[{"x"}, {"y"}]'], '[{"x", ?}, {"y", ?}]'),
    # einsum: batch and contraction from the subscripts
    ("einsum", R.einsum_rule("bij,bjk->bik", ((2, 4, 8), (2, 8, 4))), (S("x", None, "y"), S(O, "y", O)), BASIC,
     [("x",), (), ("y",), ()], ['[{"x"}, {}, {"y"}]', '[{"x"}, {"y"}, {}]'], '[{"x", ?}, {?}, {?}], partial={"y"}'),
    # slicing: whole dims pass, a forward slice is a window factor that keeps its sharding, other cuts gather
    ("index", R.index_rule((8, 8), (("full",), ("slice", 0, 4, 1))), (S("x", "y"),), BASIC,
     [("x",), ("y",)], ['[{"x"}, {"y"}]'], '[{"x", ?}, {"y", ?}]'),
    ("index step back", R.index_rule((8, 8), (("full",), ("slice", 6, 0, -2))), (S("x", "y"),), BASIC,
     [("x",), (), ()], ['[{"x"}, {}]'], '[{"x", ?}, {?}]'),
    # BASIC vs AGGRESSIVE: a closed operand keeps the shorter list under BASIC only
    ("basic", R.elementwise_rule(((8,), (8,))), (S("x"), S(("x", "y"))), BASIC,
     [("x",)], ['[{"x"}]', '[{"x"}]'], '[{"x", ?}]'),
    ("aggressive", R.elementwise_rule(((8,), (8,))), (S("x"), S(("x", "y"))), AGGRESSIVE,
     [("x", "y")], ['[{"x", "y"}]', '[{"x", "y"}]'], '[{"x", "y", ?}]'),
]


@pytest.mark.parametrize("name, rule, ins, strat, factors, targets, result", TEMPLATE_TABLE,
                         ids=[t[0] for t in TEMPLATE_TABLE])
def test_template_table(name, rule, ins, strat, factors, targets, result):
    d = propagate(rule, ins, M, strat)
    real = [f for f, size in enumerate(rule.sizes) if size > 1 or names(d)[f]]
    assert [names(d)[f] for f in real] == factors
    assert [repr(t.layout()) for t in d.operands] == targets
    assert repr(d.result) == result


@pytest.mark.parametrize("strat", [BASIC, AGGRESSIVE])
def test_explicitly_replicated_axes_are_respected(strat):
    open_dims = [DimSpec([], is_open=True), DimSpec([], is_open=True)]
    free = ShardingSpec(M, open_dims)
    pinned = ShardingSpec(M, open_dims, replicated_axes=["x"])
    assert names(propagate(EW, (S("x", None), free), M, strat))[0] == ("x",)  # an open operand takes x...
    assert names(propagate(EW, (S("x", None), pinned), M, strat))[0] == ()  # ...unless it is replicated on x
    both = S(("y", "x"), None)
    assert names(propagate(EW, (both, pinned), M, strat))[0] == ("y",)  # truncated at the banned axis


def test_permutation_factors_shard_evenly_only():
    r8 = R.index_rule((8,), (("reverse",),))
    assert repr(propagate(r8, (S("y"),), M, BASIC).result) == '[{"y", ?}]'
    r6 = R.index_rule((6,), (("reverse",),))  # 6 over 4 is uneven: mirrored blocks would not line up,
    assert repr(propagate(r6, (S("y"),), M, BASIC).result) == '[{"y:(1)2", ?}]'  # 6 over y's major half does


def test_a_decision_carries_each_operand_s_opinions_and_the_reasons_for_each_factor():
    """The conflicts of MATMUL_TABLE, told from the decision itself (nb.explain prints these lines)."""
    d = propagate(MATMUL, (S("x", None), S(None, "x")), M, AGGRESSIVE)  # m and n both want x: m's tensor wins a tie
    assert d.opinions[0] == (Opinion(0, ("x",), False, 0, 64),) and d.strategy == AGGRESSIVE
    assert why(MATMUL, d, 0) == "factor i takes [x], the longest list its operands agree on (operand 0 [x])"
    assert why(MATMUL, d, 2) == ("axis x went to factor i, which also wants it: on a tie the left operand's factor "
                                 "wins (not an elementwise op: how sharded does not count)")
    d = propagate(MATMUL, (S("x", None), S(None, "x")), M, BASIC)  # BASIC: a contested axis goes to neither
    assert why(MATMUL, d, 0) == ("strategy basic: axis x is held by another factor on some tensor, so neither takes "
                                 "it (operand 0 [x])")
    d = propagate(MATMUL, (S(None, "x"), S(None, None)), M, BASIC)  # a closed replicated operand blocks k
    assert why(MATMUL, d, 1) == ("strategy basic: a closed operand never gains an axis, so factor j stays [] "
                                 "(operand 0 [x] vs operand 1 [])")
    lhs = ShardingSpec(M, [DimSpec(["x"], priority=1), DimSpec([])])
    rhs = ShardingSpec(M, [DimSpec([]), DimSpec(["x"], priority=0)])
    d = propagate(MATMUL, (lhs, rhs), M, AGGRESSIVE)  # n's annotation is stronger (p0 < p1)
    assert why(MATMUL, d, 0) == ("axis x went to factor k, which also wants it: its annotation has the stronger "
                                 "priority (p0 < p1)")
