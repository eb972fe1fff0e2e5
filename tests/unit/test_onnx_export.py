"""nox.export: a nabla function traced into an ONNX model; onnxruntime runs it to nabla's values, every node
carries the shardings nabla chose, and nox.run reruns it. Every nabla op has a mapping."""

import ml_dtypes
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


# ---- every op on every dtype ------------------------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)
SWEEP_DTYPES = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                      "float16", "float32", "float64", "complex64", "complex128")] + [BF16]
_at = np.array


def _sg(a):
    return nb.ops.gather.scatter_add(a, _at([1, 0, 1]), 2, 0)


def _sga(a):
    return nb.ops.gather.scatter_add_along(a, _at([[0, 2, 1, 0], [1, 1, 0, 2], [2, 0, 0, 1]]), 3, 1)


def _attention(a):
    return a.reshape(1, 3, 1, 4)


# op name -> (operand count, a call of it on operands of shape (3, 4) of one dtype)
SWEEP = {
    "add": (2, lambda a, b: a + b), "subtract": (2, lambda a, b: a - b), "multiply": (2, lambda a, b: a * b),
    "divide": (2, lambda a, b: a / b), "power": (2, lambda a, b: (a ** b, a ** 3)), "maximum": (2, nb.maximum),
    "minimum": (2, nb.minimum), "less": (2, lambda a, b: a < b), "less_equal": (2, lambda a, b: a <= b),
    "greater": (2, lambda a, b: a > b), "greater_equal": (2, lambda a, b: a >= b), "equal": (2, lambda a, b: a == b),
    "not_equal": (2, lambda a, b: a != b), "negative": (1, nb.negative), "exp": (1, nb.exp), "log": (1, nb.log),
    "tanh": (1, nb.tanh), "sin": (1, nb.sin), "cos": (1, nb.cos), "sqrt": (1, nb.sqrt), "abs": (1, nb.abs),
    "relu": (1, nb.relu), "sigmoid": (1, nb.sigmoid), "floor": (1, nb.floor), "ceil": (1, nb.ceil),
    "sign": (1, nb.sign), "square": (1, nb.square), "floor_divide": (2, lambda a, b: a // b),
    "remainder": (2, lambda a, b: a % b), "where": (2, lambda a, b: nb.where(a > b, a, b)),
    "reciprocal": (1, lambda a: a ** -1),
    "astype": (1, lambda a: (a.astype("float32"), a.astype("int32"), a.astype("bool"), a.astype("uint8"))),
    "erf": (1, lambda a: nb.gelu(a, approximate=False)), "silu": (1, nb.silu), "isnan": (1, nb.isnan),
    "isfinite": (1, nb.isfinite), "gelu": (1, nb.gelu), "transpose": (1, lambda a: a.T),
    "reshape": (1, lambda a: a.reshape(4, 3)), "broadcast_to": (1, lambda a: nb.broadcast_to(a, (2, 3, 4))),
    "expand_dims": (1, lambda a: nb.expand_dims(a, 0)), "squeeze": (1, lambda a: nb.squeeze(a[:1], 0)),
    "concatenate": (2, lambda a, b: nb.concatenate([a, b], 1)), "flip": (1, lambda a: nb.flip(a, 1)),
    "roll": (1, lambda a: nb.roll(a, 1, 1)), "pad": (1, lambda a: nb.pad(a, ((1, 0), (0, 2)))),
    "take": (1, lambda a: nb.take(a, _at([2, 0, 1]), axis=1)),
    "take_along_axis": (1, lambda a: nb.take_along_axis(a, _at([[0, 3], [1, 1], [2, 0]]), 1)),
    "getitem": (1, lambda a: a[1:, ::-2]),
    "sum": (1, lambda a: (nb.sum(a, 1), nb.sum(a), nb.sum(a, 0, keepdims=True))),
    "max": (1, lambda a: (nb.max(a, 1), nb.max(a), nb.max(a, 0, keepdims=True))),
    "min": (1, lambda a: (nb.min(a, 0), nb.min(a), nb.min(a, 1, keepdims=True))),
    "argmax": (1, lambda a: (nb.argmax(a, 1), nb.argmax(a))),
    "argmin": (1, lambda a: (nb.argmin(a, 0), nb.argmin(a, keepdims=True))), "softmax": (1, lambda a: nb.softmax(a, 1)),
    "prod": (1, lambda a: (nb.prod(a, 1), nb.prod(a), nb.prod(a, 0, keepdims=True))),
    "any": (1, lambda a: nb.any(a, 1)), "all": (1, lambda a: nb.all(a, 0)), "cumsum": (1, lambda a: nb.cumsum(a, 1)),
    "matmul": (2, lambda a, b: a @ b.T), "einsum": (2, lambda a, b: nb.einsum("ij,kj->ik", a, b)),
    "tril": (1, nb.tril), "triu": (1, lambda a: nb.triu(a, 1)), "dropout": (1, lambda a: nb.dropout(a, 0.5, 3)),
    "lax_bitwise_and": (2, lax_ops.bitwise_and), "lax_bitwise_or": (2, lax_ops.bitwise_or),
    "lax_bitwise_xor": (2, lax_ops.bitwise_xor), "lax_invert": (1, lax_ops.invert),
    "lax_left_shift": (2, lax_ops.left_shift), "lax_right_shift": (2, lax_ops.right_shift),
    "lax_log1p": (1, lax_ops.log1p), "lax_expm1": (1, lax_ops.expm1), "lax_tan": (1, lax_ops.tan),
    "lax_arctan": (1, lax_ops.arctan), "lax_arcsin": (1, lax_ops.arcsin), "lax_arccos": (1, lax_ops.arccos),
    "lax_sinh": (1, lax_ops.sinh), "lax_cosh": (1, lax_ops.cosh), "lax_rem": (2, lax_ops.rem),
    "lax_asinh": (1, lax_ops.arcsinh), "lax_acosh": (1, lax_ops.arccosh), "lax_atanh": (1, lax_ops.arctanh),
    "lax_arctan2": (2, lax_ops.arctan2), "lax_rint": (1, lax_ops.rint), "lax_cbrt": (1, lax_ops.cbrt),
    "lax_erf_inv": (1, lax_ops.erf_inv), "lax_erfc": (1, lax_ops.erfc),
    "lax_bitcast_convert_type": (1, lambda a: lax_ops.bitcast(a, {1: "int8", 2: "int16", 4: "float32", 8: "int64",
                                                                  16: "complex128"}[a.dtype.itemsize])),
    "lax_threefry2x32": (1, lambda a: lax_ops.threefry2x32(*[a.astype("uint32")] * 4)),
    "sort": (1, lambda a: nb.sort(a, 1)), "argsort": (1, lambda a: nb.argsort(a, 1)),
    "top_k": (1, lambda a: nb.top_k(a, 2)), "stop_gradient": (1, nb.stop_gradient),
    "one_hot": (1, lambda a: nb.one_hot(a, 4)), "log_softmax": (1, lambda a: nb.log_softmax(a, 1)),
    "logsumexp": (1, lambda a: nb.logsumexp(a, 1)), "scatter_add": (1, _sg), "scatter_add_along": (1, _sga),
    "dot_product_attention": (1, lambda a: nb.dot_product_attention(*[_attention(a)] * 3)),
    "dot_product_attention_dq": (1, lambda a: nb.grad(lambda q: nb.dot_product_attention(
        q, _attention(a), _attention(a)).sum())(_attention(a))),
    "dot_product_attention_dkv": (1, lambda a: nb.grad(lambda k: nb.dot_product_attention(
        _attention(a), k, _attention(a)).sum())(_attention(a))),
    "dot_product_attention_dbias": (1, lambda a: nb.grad(lambda b: nb.dot_product_attention(
        *[_attention(a)] * 3, bias=b).sum())(nb.zeros((1, 1, 3, 3), a.dtype))),
    "conv": (1, lambda a: nb.conv(a.reshape(1, 1, 3, 4), a.reshape(1, 1, 3, 4)[:, :, :2, :2], padding=1)),
    "layer_norm": (1, lambda a: nb.layer_norm(a, a[0], a[1])),
    "max_pool": (1, lambda a: nb.max_pool(a.reshape(1, 1, 3, 4), 2, stride=1, padding=1)),
    "avg_pool": (1, lambda a: nb.avg_pool(a.reshape(1, 1, 3, 4), 2, stride=1, padding=1)),
}
# what the export refuses (ShardingError: no ONNX form), by op: a predicate of the operand dtype
_INTS = frozenset(np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"))
REFUSED = {
    "lax_bitcast_convert_type": lambda dt: True,  # (BitCast arrived in opset 24)
    "lax_erfc": lambda dt: dt in _INTS, "conv": lambda dt: dt in _INTS, "layer_norm": lambda dt: dt in _INTS,
    "max_pool": lambda dt: dt in _INTS and dt not in (np.dtype("bool"), np.dtype("int8"), np.dtype("uint8")),
}
# ops exported only by nabla.onnx.fuse (a rewrite of exported graphs), not by a trace of their own
NOT_SWEPT = {"conv_act", "add_relu"}


def _sweep_values(dt, reverse=False):
    """3 x 4 values that break careless code: 0, -0.0, NaN, +-inf (finite complex: onnx.reference's Expand multiplies
    by ones, which makes NaN of an infinite part), the integers' extremes, negative shift counts."""
    if dt == np.bool_:
        v = np.arange(12) % 3 == 1
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        pool = [0, 1, 2, 3, 7, 5, 1, 2, info.max, 4, 6, 2] if dt.kind == "u" else \
            [0, 1, -1, 2, 3, -5, 7, info.max, info.min, 5, -2, 1]
        v = np.array(pool, dtype=object).astype(dt)
    else:
        f = np.array([0.0, -0.0, 1.5, -2.5, np.nan, np.inf, -np.inf, 3.0, 0.5, -7.0, 2.0, 1.0])
        if dt.kind == "c":
            f = np.nan_to_num(f, nan=4.0, posinf=8.0, neginf=-9.0)
            f = f + 1j * np.roll(f, 3)
        v = f.astype(dt)
    v = v.reshape(3, 4)
    return np.ascontiguousarray(v.reshape(-1)[::-1].reshape(3, 4)) if reverse else v


def _bf16_at_the_boundary(model, feeds):
    """onnxruntime's Python API takes and gives no bfloat16 arrays: bfloat16 inputs are fed as float32 through a Cast
    to bfloat16 and outputs read through a Cast to float32 (both exact: every bfloat16 is a float32)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g, bf, f32 = m.graph, onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    pre, post = [], []
    for vi, outer in [(vi, False) for vi in g.input] + [(vi, True) for vi in g.output]:
        if vi.type.tensor_type.elem_type != bf:
            continue
        name, inner = vi.name, vi.name + "_bf16"
        for n in g.node:
            for slots in (n.input, n.output):
                for i, x in enumerate(slots):
                    if x == name:
                        slots[i] = inner
        vi.type.tensor_type.elem_type = f32
        if outer:
            post.append(onnx.helper.make_node("Cast", [inner], [name], to=f32))
        else:
            pre.append(onnx.helper.make_node("Cast", [name], [inner], to=bf))
            feeds = {**feeds, name: feeds[name].astype(np.float32)}
    nodes = pre + list(g.node) + post
    del g.node[:]
    g.node.extend(nodes)
    return m, feeds


def _run_anywhere(model, feeds):
    """onnxruntime's outputs, or onnx.reference's where onnxruntime has no kernel or no type for a node (bfloat16
    arithmetic, int16 Max, uint64 Where, complex tensors, float16 ScatterND); and which ran."""
    from onnx.reference import ReferenceEvaluator
    m, fed = _bf16_at_the_boundary(model, feeds)
    try:
        got = ort_run(m, fed)
    except Exception as e:  # noqa: BLE001 - onnxruntime's error classes are not exported
        if not any(s in str(e) for s in ("NOT_IMPLEMENTED", "is not currently registered", "type is not supported")):
            raise
        with np.errstate(all="ignore"):
            return ReferenceEvaluator(model).run(None, feeds), "reference"
    bf = {vi.name for vi in model.graph.output if vi.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}
    return [g.astype(BF16) if vi.name in bf else g for g, vi in zip(got, model.graph.output)], "onnxruntime"


def _assert_same(got, want, rtol, what):
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=rtol, atol=rtol, equal_nan=True,
                               err_msg=what)


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")  # (numpy's, casting complex to real)
@pytest.mark.parametrize("name", sorted(SWEEP))
def test_every_op_exports_on_every_dtype_to_nodes_onnx_takes_and_nablas_values(name):
    """Each exported op, on operands of every dtype nabla holds (where its eager call accepts them), gives a model
    ``onnx.checker`` passes with ONNX's full type and shape inference, that onnxruntime runs to nabla's values
    (onnx.reference where onnxruntime has no kernel or type for a node): integers bit for bit, floats to their
    precision, NaN where nabla has NaN, and the signs of zeros under onnx.reference (onnxruntime's Where returns
    +0.0 for a selected -0.0, and its Relu keeps -0.0). Or the export refuses with a ShardingError naming the op,
    where ONNX has no form for it (complex arithmetic: ONNX's math ops take no complex tensor; the ``REFUSED`` ops).

    Found by this sweep, and fixed: Pow of 8- and 16-bit and unsigned integers, ReduceMax/Min of int16 and uint16,
    TopK (top_k, sort, argsort) of bools and bfloat16, ArgMax of bools, Sin/Cos/Atan/Einsum of bfloat16 or bools,
    BitShift of signed integers: nodes ONNX's type constraints refuse; integer power, sums and products that
    onnxruntime computes through double (3 ** 39, [2**53, 1, 1, 1] summed, 3 * (2**53 + 1) in int64 were off); int64
    floor_divide and remainder through a float64 quotient; an integer lax.rem by 0 that onnxruntime fails on;
    min and argmin that dropped NaN, Sign(NaN) that gave 0; arctan2's zeros, infinities and NaN; one_hot of float
    ids truncated to classes; log1p, expm1 and cbrt that lost -0.0 (and the first two tiny values). Earlier:
    Floor(int8), Neg(uint8), BitwiseNot(bool), Less(bool), MatMul(int8)."""
    from onnx.reference import ReferenceEvaluator
    arity, fn = SWEEP[name]
    refused = REFUSED.get(name, lambda dt: False)
    for dt in SWEEP_DTYPES:
        vs = [_sweep_values(dt), _sweep_values(dt, reverse=True)][:arity]
        try:
            with np.errstate(all="ignore"):
                out = fn(*[nb.tensor(v) for v in vs])
        except (ShardingError, TypeError, ValueError, OverflowError):  # (nabla refuses it eagerly, or numpy does)
            continue
        want = [np.asarray(o.numpy()).reshape(o.shape) for o in (out if isinstance(out, tuple) else (out,))]
        what = f"{name} on {dt}"
        if refused(dt) or (dt.kind == "c" and name not in COMPLEX_MOVES):
            with pytest.raises(ShardingError, match="no ONNX form"):
                with np.errstate(all="ignore"):
                    nox.export(fn, *[nb.tensor(v) for v in vs])
            continue
        with np.errstate(all="ignore"):
            model = nox.export(fn, *[nb.tensor(v) for v in vs])
        onnx.checker.check_model(model, full_check=True)
        feeds = {vi.name: v for vi, v in zip(model.graph.input, vs)}
        got, ran = _run_anywhere(model, feeds)
        erf = any(n.op_type in ("Erf", "Gelu") for n in model.graph.node)  # (onnx.reference's Erf and
        # onnxruntime's float64 Gelu are as precise as float32)
        for g, w in zip(got, want):
            bits = w.dtype.itemsize // (2 if w.dtype.kind == "c" else 1)
            rtol = 2e-2 if w.dtype == BF16 else 4e-6 if erf and bits == 8 else {1: 0, 2: 4e-3, 4: 4e-6, 8: 1e-12}[bits]
            if name in NAN_SKIPPED:
                g = np.where(np.isnan(w), w, g)
            _assert_same(g, w, rtol, f"{what} ({ran})")
        if any(w.dtype.kind == "f" or w.dtype == BF16 for w in want):  # the signs of zeros, as ONNX means them
            with np.errstate(all="ignore"):
                ref = ReferenceEvaluator(model).run(None, feeds)
            for g, w in zip(ref, want):
                if w.dtype.kind == "f" or w.dtype == BF16:
                    g, w = np.asarray(g).astype(np.float64), w.astype(np.float64)
                    zeros = (g == 0) & (w == 0)
                    np.testing.assert_array_equal(np.signbit(g[zeros]), np.signbit(w[zeros]), err_msg=what)


# where nabla's result is NaN (a window holding NaN), onnxruntime's MaxPool and ONNX's reference skip the NaN; the
# export adds no node for it (see nabla.ops.windowed's export)
NAN_SKIPPED = {"max_pool"}
# ops that only move or pick values: they export on complex tensors (ONNX's Transpose, Gather, Where ... take them)
COMPLEX_MOVES = {"transpose", "reshape", "broadcast_to", "expand_dims", "squeeze", "concatenate", "flip", "roll", "pad",
                 "take", "take_along_axis", "getitem", "tril", "triu", "stop_gradient", "scatter_add",
                 "scatter_add_along"}


def test_every_exported_op_is_in_the_dtype_sweep():
    from nabla.ops import registry
    exported = {n for n, op in registry.REGISTRY.items() if registry.onnx_types(op)}
    assert exported - NOT_SWEPT == set(SWEEP), (sorted(exported - NOT_SWEPT - set(SWEEP)), sorted(set(SWEEP) - exported))


def test_exported_floor_divide_and_remainder_are_numpys_divmod():
    """``a - floor(a / b) * b`` and ``floor(a / b)`` round: 12345.678 % 0.7 in float32 exported as 0.47753906 (numpy
    0.4779446), 1e7 % 0.3 as 0 (0.0026357), 2.15 % inf as NaN (2.15), 1.0 // 0.1 as 10 (9), inf // 2 as inf (NaN);
    an integer divided by 0 as -2**31 (0). Integers divide in integers: the float64 quotient the export floored was
    inexact past 2**53 ((2**53 + 1) // 3 in int64 exported as 3002399751580330, numpy ...331; (2**62 + 12345) %
    1000003 as 849920, numpy 850019), and numpy's INT_MIN // -1 is INT_MIN (wrapped), x // 0 and x % 0 are 0."""
    a = np.float32([[12345.678, 1e7, 2.15, -3.11], [7.5, -7.5, np.inf, 5.0], [1.0, 4.0, -1.0, 0.1]])
    b = np.float32([[0.7, 0.3, np.inf, np.inf], [2.0, -2.0, 2.0, 0.0], [0.1, 0.4, 0.1, 0.03]])
    big = np.int64([[2 ** 62 + 12345, -(2 ** 62) - 12345], [-(2 ** 63), 2 ** 53 + 1], [7, -7], [-(2 ** 63), 5]])
    by = np.int64([[1000003, 1000003], [-1, 3], [0, -2], [0, -1]])
    cases = [(a, b), (a.astype(np.float64), b.astype(np.float64)), (np.int32([[7, -7], [5, 0]]), np.int32([[2, 2], [0, 3]])),
             (big, by), (big.astype(np.uint64), by.astype(np.uint64)), (big.astype(np.int8), by.astype(np.int8)),
             (big.astype(np.uint16), by.astype(np.uint16))]
    for x, y in cases:
        for fn in (lambda x, y: x % y, lambda x, y: x // y):
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # (the trace runs numpy's kernels)
                model = nox.export(fn, sharded(x, ["dp", "tp"]), sharded(y, [None, "tp"]))
                want = fn(x, y)
            got, _ = _run_anywhere(model, {"x": x, "y": y})
            assert got[0].dtype == want.dtype
            np.testing.assert_array_equal(got[0], want, err_msg=str(x.dtype))


@pytest.mark.parametrize("dtype", ["bool", "int8", "int16", "uint8", "uint16", "uint32", "uint64", "int32", "int64"])
def test_integer_powers_export_as_numpys_wrapping_power(dtype):
    """ONNX's Pow takes no 8- or 16-bit or unsigned integer base (the exported Pow(int8) was a model onnx.checker
    and onnxruntime refuse), and onnxruntime's int32 and int64 Pow go through double: 3 ** 39 in int64 gave
    4052555153018976256 (numpy 4052555153018976267), 7 ** 23 in int64 -2**63 (numpy's wrapped 8922003266371364727),
    3 ** 21 in int32 -2**31 (numpy's low 32 bits: 1870418611). Integer powers export as squarings and products in
    uint32 or uint64, which wrap as numpy's, cast back; no Pow node."""
    rng = np.random.default_rng(3)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        a, b = rng.integers(0, 2, (4, 6)).astype(bool), rng.integers(0, 2, (4, 6)).astype(bool)
    else:
        a = rng.integers(-9 if dt.kind == "i" else 0, 10, (4, 6)).astype(dt)
        b = rng.integers(0, min(70, np.iinfo(dt).max), (4, 6)).astype(dt)
        a[0, :3], b[0, :3] = (3, 3, 7), (39, 21, 23)
    for fn in (lambda x, y: x ** y, lambda x, y: x ** 13, lambda x, y: x ** 0, lambda x, y: y ** 1):
        with np.errstate(over="ignore"):
            want = fn(a, b)
            model = nox.export(fn, sharded(a, ["dp", "tp"]), sharded(b, [None, "tp"]))
        onnx.checker.check_model(model, full_check=True)
        assert not any(n.op_type == "Pow" for n in model.graph.node)
        got, _ = _run_anywhere(model, {"x": a, "y": b})
        assert got[0].dtype == want.dtype
        np.testing.assert_array_equal(got[0], want)


def test_max_min_argmax_of_16_bit_integers_and_of_nan_export_as_numpys():
    """ONNX's ReduceMax and ReduceMin (opset 20, the exported opset 21's) take no int16 or uint16: the exported
    ReduceMax(int16) was refused by onnx.checker and onnxruntime; they are computed in int32, which holds each value
    and its order, and cast back. ArgMax of bools was refused too (int32 now). ONNX does not say what ReduceMin and
    ArgMin make of NaN, and onnxruntime skipped it: the min over an axis of [0, NaN, 0.5] was 0 and its argmin 0
    (numpy: NaN and 1); the exported graph takes NaN (its first index) where a reduced element is NaN."""
    v = np.int16([[1, -2, 300, 7, -32768, 32767], [0, 5, 5, -1, 2, 2], [9, 8, 7, 6, 5, 4], [0, 0, 0, 0, 0, 1]])
    for x in (v, v.astype(np.uint16)):
        for fn, ref in ((lambda t: nb.max(t, 1), lambda t: t.max(1)), (lambda t: nb.min(t, 0), lambda t: t.min(0)),
                        (lambda t: nb.max(t), lambda t: t.max()), (lambda t: nb.argmax(t, 1), lambda t: t.argmax(1))):
            model = nox.export(fn, sharded(x, ["dp", "tp"]))
            onnx.checker.check_model(model, full_check=True)
            got, _ = _run_anywhere(model, {"t": x})
            np.testing.assert_array_equal(got[0], ref(x))
    f = np.float32([[0, np.nan, 0.5, 1, 2, 3], [5, 1, np.nan, -3, 0, 4], [1, 2, 3, 4, np.nan, np.nan],
                    [0.5, -0.5, 2, 1, 3, 3]])
    bools = f > 1
    for x, fn, ref in ((f, lambda t: nb.min(t, 1), lambda t: t.min(1)), (f, lambda t: nb.max(t, 0), lambda t: t.max(0)),
                       (f, lambda t: nb.argmin(t, 1), lambda t: t.argmin(1)),
                       (f, lambda t: nb.argmax(t, 0), lambda t: t.argmax(0)),
                       (bools, lambda t: nb.argmax(t, 1), lambda t: t.argmax(1))):
        model = nox.export(fn, sharded(x, ["dp", "tp"]))
        onnx.checker.check_model(model, full_check=True)
        np.testing.assert_array_equal(ort_run(model, {"t": x})[0], ref(x))


def test_top_k_and_sort_of_bools_and_bfloat16_export_to_onnxruntime():
    """ONNX's TopK takes no bools or bfloat16 (the exported top_k, sort and argsort of them were models onnx.checker
    and onnxruntime refuse): they are ranked as int32 and float32, which hold each value in the same order, and the
    values cast back; equal values keep TopK's lower-index-first order, as lax.top_k's and a stable sort's."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(4)
    bools = rng.integers(0, 2, (4, 6)).astype(bool)
    bf = rng.integers(-4, 5, (4, 6)).astype(np.float32).astype(ml_dtypes.bfloat16)  # (ties)
    for x in (bools, bf):
        for fn, ref in ((lambda t: nb.top_k(t, 3), lambda t: jax.lax.top_k(t.astype(np.float32), 3)),
                        (lambda t: nb.sort(t, 1), lambda t: (np.sort(t.astype(np.float32), 1, kind="stable"),)),
                        (lambda t: nb.argsort(t, 0), lambda t: (np.argsort(t.astype(np.float32), 0, kind="stable"),))):
            model = nox.export(fn, sharded(x, [None, None]))
            onnx.checker.check_model(model, full_check=True)
            got, ran = _run_anywhere(model, {"t": x})
            assert ran == "onnxruntime"
            for g, w in zip(got, ref(x)):
                w = np.asarray(w)
                assert g.dtype == (x.dtype if w.dtype.kind == "f" else np.intp)  # (values keep their dtype)
                np.testing.assert_array_equal(g.astype(w.dtype), w)


def test_integer_sums_and_products_export_as_numpys_wrapping_ones():
    """onnxruntime's integer ReduceSum and ReduceProd go through double: [2**53, 1, 1, 1] summed to 2**53 + 4 in
    int64 (numpy: 2**53 + 3), 3 * (2**53 + 1) was 27021597764222976 (numpy: ...979), and sums and products past
    2**63 saturated where numpy's wrap. An integer sum exports as a MatMul with ones, a product as halves
    multiplied (Mul), both exact and wrapping; numpy is the reference."""
    x = np.int64([[2 ** 53, 1, 1, 1], [2 ** 60, 3, -(2 ** 60), 1], [2 ** 62, 2 ** 62, 2 ** 62, 7], [3, 2 ** 53 + 1, 5, 7]])
    for v in (x, x.astype(np.uint64), (x % 251).astype(np.uint8), (x % 30011).astype(np.int16), x > 2):
        for fn, ref in ((lambda t: nb.sum(t, 1), lambda t: t.sum(1)), (lambda t: nb.sum(t), lambda t: t.sum()),
                        (lambda t: nb.sum(t, 0, keepdims=True), lambda t: t.sum(0, keepdims=True)),
                        (lambda t: nb.prod(t, 1), lambda t: t.prod(1)),
                        (lambda t: nb.prod(t, (0, 1), keepdims=True), lambda t: t.prod(keepdims=True)),
                        (lambda t: nb.cumsum(t, 1), lambda t: t.cumsum(1))):
            model = nox.export(fn, sharded(v, ["dp", "tp"]))
            onnx.checker.check_model(model, full_check=True)
            got, _ = _run_anywhere(model, {"t": v})
            with np.errstate(over="ignore"):
                want = ref(v)
            assert got[0].dtype == want.dtype
            np.testing.assert_array_equal(got[0], want)


def test_exported_lax_shifts_and_rem_of_signed_integers_are_xlas():
    """ONNX's BitShift takes unsigned integers only (the exported shift of an int32 was refused): a signed value is
    shifted as the unsigned one of its bits, an arithmetic right shift of a negative one as the complement of the
    logical shift of its complement; a count of the width or more (or negative) saturates, as XLA's. lax.rem by 0
    is x in XLA (its EmitIntegerRemainder: x % 0 == x, INT_MIN % -1 == 0), and onnxruntime's integer Mod fails on
    0 ("Integer modulo by zero"): it is taken over a divisor of 1 there. jax.lax on CPU (64-bit types on) is the
    reference."""
    jax = pytest.importorskip("jax")
    a = np.int32([[-7, 7, -(2 ** 31), 2 ** 31 - 1], [-1, 1, 0, 12345], [-100, 100, -2, 3]])
    b = np.int32([[1, 3, 31, 32], [40, -1, 5, 0], [0, -1, -2, 2]])
    cases = ((lax_ops.left_shift, jax.lax.shift_left), (lax_ops.right_shift, jax.lax.shift_right_arithmetic),
             (lax_ops.rem, jax.lax.rem))
    for x, y in ((a, b), (a.astype(np.int8), b.astype(np.int8)), (a.astype(np.int64), b.astype(np.int64))):
        for fn, ref in cases:
            model = nox.export(fn, sharded(x, ["dp", "tp"]), sharded(y, [None, "tp"]))
            onnx.checker.check_model(model, full_check=True)
            got, _ = _run_anywhere(model, {"a": x, "b": y})
            with jax.enable_x64(True):
                want = np.asarray(jax.jit(ref)(x, y))
            assert got[0].dtype == want.dtype
            np.testing.assert_array_equal(got[0], want, err_msg=f"{ref.__name__} {x.dtype}")


def test_exported_arctan2_log1p_expm1_cbrt_sign_at_zeros_infinities_nan_and_tiny_values():
    """Against numpy: arctan2 was atan(a / b) moved by pi, which gave pi/2 for arctan2(0, 0) (0), NaN for
    arctan2(inf, -inf) (3pi/4), pi/2 for arctan2(3, NaN) (NaN), +0.0 for arctan2(-0.0, 2) (-0.0); log1p and expm1
    were Log(1 + x) and Exp(x) - 1, which lose what 1 + x and exp(x) round away: log1p(1e-10) in float64 was
    1.00000008e-10 (1e-10), and -0.0 became +0.0, as in cbrt(-0.0); Sign(NaN) was 0 in onnxruntime's float16
    Sign. Signs of zeros are read under onnx.reference (onnxruntime's Where returns +0.0 for a selected -0.0)."""
    from onnx.reference import ReferenceEvaluator
    z = np.float64([0.0, -0.0, 0.0, -0.0, 3.0, np.inf, -np.inf, np.inf, 1.0, np.nan, -2.0, 1e-300])
    w = np.float64([0.0, 0.0, -0.0, -0.0, np.nan, -np.inf, np.inf, np.inf, -0.0, 1.0, np.inf, -1e300])
    tiny = np.float64([1e-10, -1e-10, 3e-8, -0.0, 0.0, 1e-300, np.inf, -np.inf, np.nan, -1.0, 700.0, -50.0])
    for dt in (np.float64, np.float32, np.float16):
        cases = [(lax_ops.arctan2, np.arctan2, (z.astype(dt), w.astype(dt))),
                 (lax_ops.log1p, np.log1p, (tiny.astype(dt),)), (lax_ops.expm1, np.expm1, (tiny.astype(dt),)),
                 (lax_ops.cbrt, np.cbrt, (tiny.astype(dt),)), (nb.sign, np.sign, (tiny.astype(dt),))]
        for fn, ref, args in cases:
            with np.errstate(all="ignore"):  # (the trace runs numpy's log1p of -1)
                model = nox.export(fn, *[nb.tensor(a) for a in args])
            onnx.checker.check_model(model, full_check=True)
            feeds = {vi.name: a for vi, a in zip(model.graph.input, args)}
            with np.errstate(all="ignore"):
                want = ref(*args)
            tol = 8 * np.finfo(dt).eps
            with np.errstate(all="ignore"):
                ref = ReferenceEvaluator(model).run(None, feeds)[0]
            for got in (_run_anywhere(model, feeds)[0][0], ref):
                np.testing.assert_allclose(got, want, rtol=tol, atol=0, equal_nan=True, err_msg=f"{fn} {dt}")
            zeros = want == 0
            np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(want[zeros]), err_msg=f"{fn} {dt}")


def test_exported_one_hot_compares_float_ids_as_they_are():
    """one_hot compares ids with the classes (jax.nn.one_hot's definition, ``x[..., None] == arange(n)``, here in
    numpy): a float id 1.5 is no class. The export cast float ids to int64 first, so 1.5 was class 1."""
    ids = np.float32([[0.0, 1.5, 3.0], [np.nan, -0.0, 2.0]])
    model = nox.export(lambda i: nb.one_hot(i, 4), sharded(ids, ["dp", None]))
    want = (ids[..., None] == np.arange(4)).astype(np.float32)
    np.testing.assert_array_equal(ort_run(model, {"i": ids})[0], want)


def test_complex_arithmetic_export_refuses_naming_the_op():
    """ONNX's math ops and comparisons take no complex tensors: the export wrote Add(complex64) and Less(complex64),
    models onnx.checker refuses; it raises a ShardingError naming the op and its operands' dtypes. Moving complex
    values (Transpose, Gather, Where ...) exports."""
    c = sharded((X + 1j * Y).astype(np.complex64), ["dp", None])
    for fn, name in ((lambda a: a + a, "add"), (lambda a: a < a, "less"), (nb.exp, "exp"), (nb.abs, "abs")):
        with pytest.raises(ShardingError, match=f"op '{name}' .*complex64.* no ONNX form"):
            nox.export(fn, c)
    model = nox.export(lambda a: a.T[::-1], c)
    onnx.checker.check_model(model, full_check=True)
