"""nox.export: a nabla function traced into an ONNX model; onnxruntime runs it to nabla's values, every node
carries the shardings nabla chose, and nox.run reruns it. Every nabla op has a mapping."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import nabla as nb  # noqa: E402
import nabla.onnx as nox  # noqa: E402
from nabla import DeviceMesh, ShardingError, ShardingSpec  # noqa: E402
from nabla.executor import OpDef, run as execute  # noqa: E402
from nabla.onnx.export import MAPPING  # noqa: E402
from nabla.ops import lax_ops  # noqa: E402
from nabla.rules import elementwise_rule  # noqa: E402
from nabla.tensor import Tensor  # noqa: E402

MESH = DeviceMesh("cluster", (2, 2), ("dp", "tp"))
RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def sharded(a, dims):
    return nb.tensor(a).shard(MESH, dims)


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def leaves(tree):
    from nabla.pytree import flatten
    return flatten(tree)[0]


def check_export(fn, *args, rtol=1e-5, atol=1e-6, rerun=True):
    """Export ``fn``, validate the model, run it on onnxruntime (and on nabla) and compare with ``fn``."""
    want = [o.numpy() for o in leaves(fn(*args))]
    m = nox.export(fn, *args)
    onnx.checker.check_model(m, full_check=True)
    try:  # seed 001's checker accepts the annotations, except where nabla's ceil rule leaves a shard empty
        nox.check(m)
    except ShardingError as e:
        assert "a shard count may not exceed its dim" in str(e), e
    feeds = {vi.name: t.numpy() for vi, t in zip(m.graph.input, [t for a in args for t in leaves(a)
                                                                  if isinstance(t, Tensor)])}
    got = ort_run(m, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    if rerun:
        ins = dict(zip([vi.name for vi in m.graph.input], [t for a in args for t in leaves(a) if isinstance(t, Tensor)]))
        again = nox.run(m, ins, mesh=MESH if m.configuration else None)
        for vi, w in zip(m.graph.output, want):
            np.testing.assert_allclose(again[vi.name].numpy(), w, rtol=rtol, atol=atol)
    return m


def node_specs(m, rank_of):
    """tensor name -> ShardingSpec, over every annotation of the model."""
    out = {}
    for n in m.graph.node:
        for c in n.device_configurations:
            assert c.configuration_id == MESH.name
            for s in c.sharding_spec:
                assert s.tensor_name in list(n.input) + list(n.output)
                out.setdefault(s.tensor_name, []).append(nox.spec_from_onnx(s, MESH, rank_of[s.tensor_name]))
    return out


def ranks(m):
    inferred = onnx.shape_inference.infer_shapes(m)
    g = inferred.graph
    vis = list(g.value_info) + list(g.input) + list(g.output)
    r = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in vis}
    r.update({i.name: len(i.dims) for i in g.initializer})
    return r


# ---- coverage ---------------------------------------------------------------------------------------------


def test_every_nabla_op_has_a_mapping():
    import nabla.ops as ops
    found = set()
    for v in vars(ops).values():
        if isinstance(v, OpDef):
            found.add(v.name)
        elif isinstance(v, dict):
            found |= {d.name for d in v.values() if isinstance(d, OpDef)}
    assert found, "no OpDefs found in nabla.ops"
    assert found <= set(MAPPING), sorted(found - set(MAPPING))


# ---- one op at a time, on sharded operands ----------------------------------------------------------------

X = rand(4, 6)
Y = rand(4, 6)
POS = np.abs(rand(4, 6)) + 0.5

ELEMENTWISE = [
    ("add", lambda a, b: a + b), ("subtract", lambda a, b: a - b), ("multiply", lambda a, b: a * b),
    ("divide", lambda a, b: a / b), ("maximum", nb.maximum), ("minimum", nb.minimum),
    ("less", lambda a, b: a < b), ("less_equal", lambda a, b: a <= b), ("greater", lambda a, b: a > b),
    ("greater_equal", lambda a, b: a >= b), ("equal", lambda a, b: a == b), ("not_equal", lambda a, b: a != b),
    ("where", lambda a, b: nb.where(a > b, a, b)),
]


@pytest.mark.parametrize("name, fn", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
@pytest.mark.parametrize("dims", [["dp", "tp"], [None, "tp"], [None, None]])
def test_binary(name, fn, dims):
    check_export(fn, sharded(X, dims), sharded(Y, ["dp", None]))


UNARY = ["negative", "exp", "tanh", "sin", "cos", "abs", "relu", "sigmoid"]


@pytest.mark.parametrize("name", UNARY)
def test_unary(name):
    check_export(getattr(nb, name), sharded(X, ["dp", "tp"]))


@pytest.mark.parametrize("name", ["log", "sqrt"])
def test_unary_positive(name):
    check_export(getattr(nb, name), sharded(POS, [None, "tp"]))


def test_power_and_scalars():
    check_export(lambda a: (a ** 2.0) * 3 - 1.5 / (a + 4.0), sharded(POS, ["dp", "tp"]))
    check_export(lambda a, b: nb.power(a, b), sharded(POS, ["dp", None]), sharded(X, [None, "tp"]))


def test_mixed_dtypes_follow_numpy():
    i = nb.tensor(np.arange(24, dtype=np.int32).reshape(4, 6)).shard(MESH, ["dp", None])
    check_export(lambda a, b: a + b, i, sharded(X, [None, "tp"]))  # int32 + float32 -> float64
    check_export(lambda a: a / 4, i)  # true division of ints -> float64
    check_export(lambda a: nb.exp(a), i)
    check_export(lambda a: (a > 3) + (a < 10), i)  # bool + bool: logical or
    check_export(lambda a: a.astype("float16") * 2, sharded(X, ["dp", "tp"]), rtol=1e-3)
    check_export(lambda a: nb.where(a, 1.0, 0.0), i)  # a non-bool condition


@pytest.mark.parametrize("axes", [0, 1, (0, 1), None])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(axes, keepdims):
    x = sharded(X, ["dp", "tp"])
    check_export(lambda a: nb.sum(a, axes, keepdims), x)
    check_export(lambda a: nb.max(a, axes, keepdims), x)
    check_export(lambda a: nb.min(a, axes, keepdims), x)
    check_export(lambda a: nb.mean(a, axes, keepdims), x)


def test_argmax_and_softmax():
    x = sharded(X, ["dp", "tp"])
    check_export(lambda a: nb.argmax(a, 1), x)  # over a sharded dim: composed of max, where and min
    check_export(lambda a: nb.argmax(a, 0), sharded(X, [None, "tp"]))  # the argmax primitive
    check_export(lambda a: nb.argmax(a), sharded(X, [None, None]))
    check_export(lambda a: nb.softmax(a, 1), x)  # over a sharded dim: max, exp, sum, divide
    check_export(lambda a: nb.softmax(a, 0), sharded(X, [None, "tp"]))  # the softmax primitive


def test_contractions():
    a, b = sharded(rand(4, 8), ["dp", "tp"]), sharded(rand(8, 6), ["tp", None])
    check_export(lambda a, b: a @ b, a, b)
    check_export(lambda a, b: nb.matmul(a, b[:, 0]), a, b)  # a 1-D operand
    check_export(lambda a, b: nb.einsum("ij,jk->ik", a, b), a, b)
    check_export(lambda a, b: nb.einsum("ij, jk", a, b), a, b)  # numpy's implicit output
    c = sharded(rand(2, 3, 4, 5), ["dp", None, None, "tp"])
    d = sharded(rand(2, 3, 5, 4), ["dp", None, "tp", None])
    check_export(lambda c, d: c @ d, c, d)
    check_export(lambda c, d: nb.einsum("bhqd,bhdk->bhqk", c, d), c, d)


def test_moving_elements():
    x = sharded(rand(4, 6, 2), ["dp", "tp", None])
    check_export(lambda a: a.transpose(2, 0, 1), x)
    check_export(lambda a: a.T, x)
    check_export(lambda a: nb.swapaxes(a, 0, 1), x)
    check_export(lambda a: a.reshape(4, 12), x)
    check_export(lambda a: a.reshape(-1), x)
    check_export(lambda a: a.reshape(2, 2, 3, 4), x)
    check_export(lambda a: nb.broadcast_to(a[:, :1], (4, 6, 2)), x)
    check_export(lambda a: nb.broadcast_to(a, (3, 4, 6, 2)), x)
    check_export(lambda a: nb.expand_dims(a, (0, 2)), x)
    check_export(lambda a: nb.squeeze(a[:, :1], 1), x)
    check_export(lambda a: nb.squeeze(a[:1, :1]), x)
    check_export(lambda a: nb.concatenate([a, a * 2, a[:, :1]], 1), x)
    check_export(lambda a: nb.concatenate([a, a], 0), x)


KEYS = [
    (slice(1, 3),), (slice(None, None, -1),), (slice(None), slice(None, None, -1)), (slice(4, 0, -2),),
    (slice(None, None, -2),), (1,), (-1, 2), (None, slice(1, 5, 2)), (Ellipsis, None), (1, None, slice(2, None), 0),
    (slice(3, 1),), (slice(None),),
]


@pytest.mark.parametrize("key", KEYS, ids=[repr(k) for k in KEYS])
def test_getitem(key):
    check_export(lambda a: a[key], sharded(rand(4, 6, 2), ["dp", "tp", None]))


def test_windowed_ops_and_norms():
    x = sharded(rand(2, 4, 9, 8), [None, None, "dp", "tp"])  # spatial dims sharded: halos
    w = nb.tensor(rand(6, 2, 3, 3))
    b = nb.tensor(rand(6))
    check_export(lambda x: nb.conv(x, w, b, stride=(2, 1), padding=((1, 2), (0, 1)), dilation=(1, 2), groups=2), x,
                 rtol=1e-4, atol=1e-5)
    check_export(lambda x, w: nb.conv(x, w, padding=1), x, sharded(rand(6, 4, 3, 3), ["tp", None, None, None]),
                 rtol=1e-4, atol=1e-5)
    check_export(lambda x: nb.max_pool(x, 3, stride=2, padding=1), x)
    check_export(lambda x: nb.max_pool(x, (2, 3), stride=1, dilation=(2, 1)), x)
    check_export(lambda x: nb.avg_pool(x, 3, stride=2, padding=1), x)
    check_export(lambda x: nb.avg_pool(x, 3, stride=2, padding=1, count_include_pad=False), x)
    check_export(lambda x: nb.avg_pool(x, 2, dilation=2), x)
    check_export(nb.global_avg_pool, x)
    c = nb.tensor(rand(4))
    check_export(lambda x: nb.batch_norm(x, c, nb.abs(c) + 1.0, c * 2, c), x, rtol=1e-4, atol=1e-5)
    check_export(lambda x, s: nb.layer_norm(x, s, s * 0.5), sharded(rand(4, 8), ["dp", "tp"]),
                 sharded(rand(8), ["tp"]), rtol=1e-4, atol=1e-5)
    w1 = nb.tensor(rand(3, 4, 5))
    check_export(lambda x: nb.conv(x, w1), sharded(rand(2, 4, 12), [None, None, "dp"]), rtol=1e-4, atol=1e-5)  # 1-D


# ---- the graph's interface ----------------------------------------------------------------------------------


def test_inputs_in_order_constants_as_initializers_and_outputs():
    w = nb.tensor(rand(6, 3))

    def f(x, scale, y):
        return {"h": (x @ w) * scale, "y": y, "c": w}

    x, y = sharded(X, ["dp", None]), sharded(Y, [None, "tp"])
    m = check_export(f, x, 2.0, y)
    assert [vi.name for vi in m.graph.input] == ["x", "y"]  # the tensor arguments, in order, by parameter name
    assert [vi.name for vi in m.graph.output] == ["h", "y_1", "c"]  # dict keys (y_1: "y" names the input)
    assert any(list(i.dims) == [6, 3] for i in m.graph.initializer)  # the captured weight
    assert {d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim} == {4, 6}


def test_pytree_arguments_and_several_outputs():
    params = {"w1": sharded(rand(6, 8), [None, "tp"]), "w2": sharded(rand(8, 6), ["tp", None])}

    def mlp(params, x):
        h = nb.relu(x @ params["w1"])
        return h @ params["w2"], h

    m = check_export(mlp, params, sharded(X, ["dp", None]))
    assert [vi.name for vi in m.graph.input] == ["params.w1", "params.w2", "x"]
    assert len(m.graph.output) == 2


def test_same_value_returned_twice_and_an_input_returned():
    m = check_export(lambda a: (a, nb.exp(a), nb.exp(a) * 1.0, a), sharded(X, ["dp", None]))
    assert [o.name for o in m.graph.output] == ["output_0", "output_1", "output_2", "output_3"]


def test_unsharded_tensors_give_a_model_without_configuration():
    m = check_export(lambda a, b: nb.tanh(a @ b.T), nb.tensor(X), nb.tensor(Y))
    assert not m.configuration
    assert all(not n.device_configurations for n in m.graph.node)


def test_abstract_arguments():
    x = nb.abstract((8, 16)).shard(MESH, ["dp", None])
    w = nb.abstract((16, 32)).shard(MESH, [None, "tp"])
    m = nox.export(lambda x, w: nb.softmax(nb.relu(x @ w), -1), x, w)
    onnx.checker.check_model(m)
    xs, ws = rand(8, 16), rand(16, 32)
    got, = ort_run(m, {"x": xs, "w": ws})
    h = np.maximum(xs @ ws, 0)
    e = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    with pytest.raises(ShardingError, match="abstract"):
        nox.export(lambda x: x @ nb.abstract((16, 4)), x)


# ---- shardings --------------------------------------------------------------------------------------------


def test_nodes_carry_the_shardings_nabla_chose():
    x = sharded(rand(8, 16), ["dp", "tp"])
    w1 = sharded(rand(16, 32), [None, "tp"])
    w2 = sharded(rand(32, 16), ["tp", None])

    trace = {}

    def f(x, w1, w2):
        h = x @ w1  # x's contraction dim is gathered (tp is taken by the result's columns)
        a = nb.relu(h)
        y = a @ w2  # partial sums over tp
        trace.update(h=h, a=a, y=y)
        return nb.tanh(y)  # summed here

    m = check_export(f, x, w1, w2, rtol=1e-4, atol=1e-5)
    assert [c.name for c in m.configuration] == [MESH.name] and m.configuration[0].num_devices == 4
    specs = node_specs(m, ranks(m))
    by_op = {n.op_type: n for n in m.graph.node}
    mm1, mm2 = [n for n in m.graph.node if n.op_type == "MatMul"]
    assert set(specs[mm1.output[0]]) == {ShardingSpec(MESH, ["dp", "tp"])}
    assert trace["h"].sharding.layout() == ShardingSpec(MESH, ["dp", "tp"])
    # y is partial over tp: its annotation names its dims only
    assert trace["y"].sharding.partial_axes == ("tp",)
    assert set(specs[mm2.output[0]]) == {ShardingSpec(MESH, ["dp", None])}
    # the operand layouts the kernels received
    assert ShardingSpec(MESH, ["dp", None]) in specs["x"]
    assert ShardingSpec(MESH, ["tp", None]) in specs["w2"]
    assert by_op["Relu"].device_configurations
    # every node of the model is checkable, and nox.check accepts the annotations
    nox.check(m)


def test_relayout_and_place_are_identities_with_the_target_annotated():
    def f(a):
        b = nb.exp(a).with_sharding(MESH, [None, "tp"])
        return b * 2.0

    m = check_export(f, sharded(X, ["dp", None]))
    ident = [n for n in m.graph.node if n.op_type == "Identity"]
    assert len(ident) == 1
    (s,), = [c.sharding_spec for c in ident[0].device_configurations]
    assert nox.spec_from_onnx(s, MESH, 2) == ShardingSpec(MESH, [None, "tp"])

    def g(a):
        return nb.exp(a).shard(MESH, ["dp", "tp"])  # a host value placed on the mesh

    m = check_export(g, nb.tensor(X))
    (s,), = [c.sharding_spec for n in m.graph.node for c in n.device_configurations if n.op_type == "Identity"]
    assert nox.spec_from_onnx(s, MESH, 2) == ShardingSpec(MESH, ["dp", "tp"])


def test_rerun_on_nabla_keeps_the_layouts():
    x = sharded(rand(2, 3, 8, 8), [None, None, "dp", "tp"])
    w = nb.tensor(rand(4, 3, 3, 3))

    def f(x):
        return nb.max_pool(nb.relu(nb.conv(x, w, padding=1)), 2)

    m = check_export(f, x, rtol=1e-4, atol=1e-5)
    want = f(x)
    again = nox.run(m, {"x": x}, mesh=MESH)["output"]
    assert again.sharding.layout() == want.sharding.layout() == ShardingSpec(MESH, [None, None, "dp", "tp"])
    with nb.comm_log() as log:
        nox.run(m, {"x": x}, mesh=MESH)
    assert set(log.counts) == {"collective_permute"}  # halos only, as in nabla's own run


def test_two_meshes_and_custom_device_ids_raise():
    other = DeviceMesh("other", (2,), ("d",))
    with pytest.raises(ShardingError, match="mesh"):
        nox.export(lambda a, b: (nb.exp(a), nb.exp(b)), sharded(X, ["dp", None]), nb.tensor(Y).shard(other, ["d", None]))
    odd = DeviceMesh("odd", (2,), ("d",), devices=[5, 7])
    with pytest.raises(ShardingError, match="device ids"):
        nox.export(nb.exp, nb.tensor(X).shard(odd, ["d", None]))


def test_an_op_without_onnx_form_raises_naming_it():
    frob = OpDef("frobnicate", lambda shapes: elementwise_rule(tuple(shapes)), lambda arrays, local: arrays[0] * 2)

    def f(a):
        return execute(frob, [nb.exp(a)], (), Tensor)

    with pytest.raises(ShardingError, match="frobnicate"):
        nox.export(f, sharded(X, ["dp", None]))
    with pytest.raises(ShardingError, match="must return tensors"):
        nox.export(lambda a: 3, sharded(X, ["dp", None]))


@pytest.mark.parametrize("dtype, c", [("float32", 0.3), ("int32", 3)])
def test_floor_divide_remainder_and_square_export_to_onnxruntime_s_values(dtype, c):
    """numpy floors a quotient and gives a remainder the divisor's sign; ONNX's integer Div truncates and its
    float Mod takes the dividend's sign, so they export as Floor(Div) and a - Floor(Div) * b (in float64 for
    integers, cast back); onnxruntime's values and dtypes are numpy's."""
    v = np.array([[-7, -2, 5, 8], [1, 0, -1, 9]]).astype(dtype)
    t = nb.tensor(v).shard(DeviceMesh("fd", (2,), ("x",)), ["x", None])
    for f, want in ((lambda a: a // c, v // c), (lambda a: a % c, v % c), (nb.square, np.square(v))):
        sess = ort.InferenceSession(nox.export(f, t).SerializeToString())
        got = sess.run(None, {sess.get_inputs()[0].name: v})[0]
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---- the graph is read from the recorded steps ----------------------------------------------------------------


def test_the_graph_follows_the_steps_a_comm_log_records_of_the_same_call():
    """One node per recorded step, in the order they ran, each annotated with the layouts the step records: the
    operands as the kernel received them (``Use.dst``) and the result (dims only). The program moves a value
    with with_sharding and places a host value on the mesh: both are Identities annotated with their target."""
    from nabla.step import PLACE, RELAYOUT

    def f(a, c):
        b = nb.exp(a).with_sharding(MESH, [None, "tp"])
        p = nb.tanh(c).shard(MESH, ["dp", "tp"])  # a host value placed on the mesh
        return b * p + 1.0

    a, c = sharded(X, ["dp", None]), nb.tensor(Y)
    a2, c2 = sharded(X, ["dp", None]), nb.tensor(Y)
    with nb.comm_log() as log:
        f(a2, c2)
    steps = log.steps
    assert [s.name for s in steps] == ["exp", RELAYOUT, "tanh", PLACE, "multiply", "add"]
    m = check_export(f, a, c)
    assert [(n.op_type,) for n in m.graph.node] == [MAPPING[s.name] if s.op not in (RELAYOUT, PLACE) else
                                                 ("Identity",) for s in steps]
    rank = ranks(m)

    def dims(spec):  # what an annotation says of a layout: its dims, closed, without partial axes
        return ShardingSpec(MESH, [d.axes for d in spec.dim_specs])

    for n, s in zip(m.graph.node, steps):
        got = {sp.tensor_name: nox.spec_from_onnx(sp, MESH, rank[sp.tensor_name])
               for cfg in n.device_configurations for sp in cfg.sharding_spec}
        want = {n.output[0]: dims(s.out_spec)} if s.out_spec is not None else {}
        if s.op not in (RELAYOUT, PLACE):
            want.update({name: dims(u.dst) for name, u in zip(n.input, s.uses) if u.value and u.dst is not None})
        assert got == want, (s.name, got, want)
    assert dims(steps[1].out_spec) == ShardingSpec(MESH, [None, "tp"])  # the relayout's and the place's targets
    assert dims(steps[3].out_spec) == ShardingSpec(MESH, ["dp", "tp"])


def test_an_op_made_of_steps_is_one_node_and_a_gradient_inside_is_its_steps():
    """log_softmax over a sharded dim runs as max, sum and log steps but is written as the one op it was called
    as; a gradient (and a checkpoint) taken inside the function is exported as the steps of its backward pass,
    so the model computes it from its inputs."""
    x, x1 = sharded(X, ["dp", "tp"]), sharded(X, ["dp", "tp"])
    with nb.comm_log() as log:
        nb.log_softmax(x1, 1)
    assert len(log.steps) > 1
    m = check_export(lambda a: nb.log_softmax(a, 1), x)
    assert [n.op_type for n in m.graph.node] == ["LogSoftmax"]

    w = sharded(rand(6, 3), ["tp", None])

    def f(a, w):
        return nb.grad(lambda w: nb.checkpoint(lambda w: nb.tanh(a @ w))(w).sum())(w)

    m = check_export(f, x, w, rtol=1e-4, atol=1e-5, rerun=False)
    x2 = X * 2
    got, = ort_run(m, {"a": x2, "w": w.numpy()})
    np.testing.assert_allclose(got, f(sharded(x2, ["dp", "tp"]), w).numpy(), rtol=1e-4, atol=1e-5)


def test_a_gradient_bucket_inside_is_one_identity_per_gradient():
    """DDP's gradient bucket (one recorded step summing several gradients) is one Identity per gradient,
    annotated with its layout."""
    r = np.random.default_rng(5)
    ps = {f"w{i}": sharded(r.standard_normal((8, 8)).astype(np.float32), [None, None]) for i in range(2)}

    def loss(p, x):
        for i in range(2):
            x = nb.tanh(x @ p[f"w{i}"])
        return x.sum()

    f = lambda p, x: nb.grad(loss, bucket_bytes=1 << 20)(p, x)  # noqa: E731
    x = sharded(rand(4, 8), ["dp", None])
    with nb.comm_log() as log:
        f(ps, sharded(rand(4, 8), ["dp", None]))
    assert [s.name for s in log.steps].count("bucket") == 1
    m = check_export(f, ps, x, rtol=1e-4, atol=1e-5, rerun=False)
    assert [n.op_type for n in m.graph.node][-2:] == ["Identity", "Identity"]
    assert [o.name for o in m.graph.output] == ["w0", "w1"]


def test_an_exported_gradient_names_its_inputs_after_the_function_differentiated():
    """``nb.grad(f)`` and ``nb.value_and_grad(f)`` carry ``f``'s name and parameters (as jax.grad's wrapper does), so
    the model's inputs are ``p.w1 .. y`` as ``nb.jit(f)``'s are, not ``args_0.w1``; fed by those names, onnxruntime
    gives jax.grad's gradient."""
    jax = pytest.importorskip("jax")

    def loss_fn(p, x, y):
        return ((nb.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()

    host = {"w1": rand(4, 8), "w2": rand(8, 2)}
    xs, ys = rand(6, 4), rand(6, 2)
    args = ({k: nb.tensor(v) for k, v in host.items()}, sharded(xs, ["dp", None]), sharded(ys, ["dp", None]))
    model = nox.export(nb.grad(loss_fn), *args)
    assert model.graph.name == "loss_fn" and [i.name for i in model.graph.input] == ["p.w1", "p.w2", "x", "y"]
    got = ort_run(model, {"p.w1": host["w1"], "p.w2": host["w2"], "x": xs, "y": ys})
    want = jax.grad(lambda p: ((jax.numpy.tanh(xs @ p["w1"]) @ p["w2"] - ys) ** 2).mean())(host)
    np.testing.assert_allclose(got[0], want["w1"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want["w2"], rtol=1e-5, atol=1e-6)
    named = nox.export(nb.value_and_grad(loss_fn, argnums=1), *args)
    assert [i.name for i in named.graph.input] == ["p.w1", "p.w2", "x", "y"]


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "uint32", "int64", "uint64"])
def test_integer_and_bool_operands_export_to_nodes_onnx_types_allow(dtype):
    """ONNX's Floor, Ceil and Round take floats, its Relu and Neg signed numbers, Abs, Bitwise*, Less and Greater
    no bools, MatMul no 8- or 16-bit integers: the export wrote them over such operands anyway (Floor(int8),
    Neg(uint8), BitwiseNot(bool), Less(bool), MatMul(int8): models onnx.checker and onnxruntime refused); it writes
    what they are there (identities, 0 - x, Not..., MatMul in int32 cast back)."""
    v = (np.arange(8).reshape(4, 2) * 77 - 100).astype(dtype) if dtype != "bool" else np.arange(8).reshape(4, 2) % 3 == 0
    x = sharded(v, ["dp", "tp"])
    fns = [nb.floor, nb.ceil, nb.abs]
    fns += [nb.relu] if dtype[0] in "bu" else []  # (onnxruntime has no int8 or int64 Relu kernel)
    fns += [nb.negative, nb.sign] if dtype != "bool" else []  # (numpy's negative and sign refuse bools)
    if dtype == "bool":
        fns.append(lambda a: lax_ops.bitwise_xor(lax_ops.invert(a), lax_ops.bitwise_and(a, a[::-1])))
    fns += [lambda a: a < a[::-1], lambda a: a >= a[:, ::-1], lambda a: a != a[::-1]]  # (Less(bool) was refused)
    fns += [lambda a: a.T @ a]  # MatMul of int8, uint8 or bools: refused too
    for fn in fns:
        model = nox.export(fn, x)
        onnx.checker.check_model(model, full_check=True)
        got = ort_run(model, {model.graph.input[0].name: v})[0]
        with np.errstate(over="ignore"):
            want = fn(x).numpy()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_exported_floor_divide_and_remainder_are_numpys_divmod():
    """``a - floor(a / b) * b`` and ``floor(a / b)`` round: 12345.678 % 0.7 in float32 exported as 0.47753906 (numpy
    0.4779446), 1e7 % 0.3 as 0 (0.0026357), 2.15 % inf as NaN (2.15), 1.0 // 0.1 as 10 (9), inf // 2 as inf (NaN);
    an integer divided by 0 as -2**31 (0)."""
    a = np.float32([[12345.678, 1e7, 2.15, -3.11], [7.5, -7.5, np.inf, 5.0], [1.0, 4.0, -1.0, 0.1]])
    b = np.float32([[0.7, 0.3, np.inf, np.inf], [2.0, -2.0, 2.0, 0.0], [0.1, 0.4, 0.1, 0.03]])
    for x, y in ((a, b), (a.astype(np.float64), b.astype(np.float64)), (np.int32([[7, -7], [5, 0]]), np.int32([[2, 2], [0, 3]]))):
        for fn in (lambda x, y: x % y, lambda x, y: x // y):
            with np.errstate(divide="ignore", invalid="ignore"):  # (the trace runs nabla's kernels, numpy's)
                model = nox.export(fn, sharded(x, ["dp", "tp"]), sharded(y, [None, "tp"]))
                np.testing.assert_array_equal(ort_run(model, {"x": x, "y": y})[0], fn(x, y))
