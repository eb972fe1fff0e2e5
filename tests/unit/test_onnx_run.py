"""nox.run: validation before anything runs, placement of inputs and initializers, annotations as
with_sharding, outputs without pending sums; a few op-table entries the node tests do not reach."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import nabla as nb  # noqa: E402
import nabla.onnx as nox  # noqa: E402
from nabla import DeviceMesh, ShardingError, ShardingSpec  # noqa: E402
from nabla.onnx.ops import OPS  # noqa: E402
from nabla.testing import assert_comm, assert_sharded_allclose  # noqa: E402

F = TensorProto.FLOAT
MESH = DeviceMesh("m", (2,), ("d",))


def model(nodes, inputs, outputs, inits=(), opset=21, config=None):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    if config:
        m.configuration.append(onnx.DeviceConfigurationProto(name=config[0], num_devices=config[1]))
    return m


def spec(name, devices, dims):
    p = onnx.ShardingSpecProto(tensor_name=name, device=devices)
    for axis, n in dims.items():
        p.sharded_dim.append(onnx.ShardedDimProto(axis=axis, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=n)]))
    return p


def annotated(n, cfg, *specs):
    n.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=cfg, sharding_spec=list(specs)))
    return n


def test_unsupported_op_is_reported_before_anything_runs(monkeypatch):
    monkeypatch.delitem(OPS, "Det", raising=False)  # unsupported here even once nabla.onnx runs it
    relu = annotated(helper.make_node("Relu", ["x"], ["r"], name="relu"), "pair", spec("x", [0, 1], {0: 2}))
    nodes = [relu, helper.make_node("Det", ["r"], ["y"], name="det")]
    m = model(nodes, [("x", F, [4, 4])], [("y", F, [])], config=("pair", 2))
    with nb.comm_log() as log, pytest.raises(ShardingError, match=r"node 'det' \(Det\): op type 'Det' is not supported"):
        nox.run(m, {"x": nb.tensor(np.ones((4, 4), np.float32)).shard(DeviceMesh("pair", (2,), ("d",)), ["d", None])})
    assert log.events == []
    custom = model([helper.make_node("Gelu", ["x"], ["y"], name="g", domain="com.microsoft")],
                   [("x", F, [2])], [("y", F, [2])])
    custom.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(ShardingError, match=r"node 'g' \(Gelu\): op type 'Gelu' in domain 'com.microsoft'"):
        nox.run(custom, {"x": np.ones(2, np.float32)})


def test_static_attribute_checks_run_first():
    m = model([helper.make_node("Exp", ["x"], ["e"], name="e"),
               helper.make_node("Cast", ["e"], ["y"], name="to_i4", to=TensorProto.INT4)],
              [("x", F, [2])], [("y", TensorProto.INT4, [2])])
    with pytest.raises(ShardingError, match=r"node 'to_i4' \(Cast\): nabla tensors cannot hold INT4"):
        nox.run(m, {"x": np.ones(2, np.float32)})


def test_bfloat16_and_float8_tensors_run_and_casts_to_float8_saturate_as_onnx_does():
    """ONNX's Cast to float8 saturates by default (saturate=1): out-of-range values become the largest finite
    one (numpy's cast gives NaN), as onnx's reference implementation computes."""
    from onnx.reference import ReferenceEvaluator
    m = model([helper.make_node("Cast", ["x"], ["h"], name="to_bf16", to=TensorProto.BFLOAT16),
               helper.make_node("Cast", ["h"], ["y"], name="to_f8", to=TensorProto.FLOAT8E4M3FN)],
              [("x", F, [4])], [("y", TensorProto.FLOAT8E4M3FN, [4])])
    x = np.array([1.5, -600.0, 1000.0, np.nan], np.float32)
    got = nox.run(m, {"x": x})["y"].numpy()
    want, = ReferenceEvaluator(m).run(None, {"x": x})
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))  # 448 and -448 saturated


def test_initializers_are_placed_open_and_inputs_default_to_them():
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32), "w")
    m = model([helper.make_node("Add", ["x", "w"], ["y"], name="add")],
              [("x", F, [4, 6]), ("w", F, [6])], [("y", F, [4, 6])], inits=[w])
    x = np.ones((4, 6), np.float32)
    with nb.comm_log() as log:
        y = nox.run(m, {"x": nb.tensor(x).shard(MESH, [None, "d"])})["y"]
    assert log.events == []  # w is cut where x is, locally
    assert y.sharding.dim_specs[1].axes == ("d",)
    assert_sharded_allclose(y, x + np.arange(6))
    other = np.full(6, 2, np.float32)  # a given value overrides the initializer
    np.testing.assert_array_equal(nox.run(m, {"x": x, "w": other})["y"].numpy(), x + 2)


def test_host_run_without_mesh():
    m = model([helper.make_node("Sigmoid", ["x"], ["y"])], [("x", F, [3])], [("y", F, [3])])
    y = nox.run(m, {"x": [0.0, 1.0, -1.0]})["y"]
    assert y.sharding is None
    np.testing.assert_allclose(y.numpy(), 1 / (1 + np.exp(-np.array([0, 1, -1.0]))), rtol=1e-6)


def test_outputs_carry_no_partial_sums():
    m = model([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
              [("a", F, [4, 6]), ("b", F, [6, 2])], [("y", F, [4, 2])])
    a, b = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)[0], np.ones((6, 2), np.float32)
    with nb.comm_log() as log:
        y = nox.run(m, {"a": nb.tensor(a).shard(MESH, [None, "d"]), "b": nb.tensor(b).shard(MESH, ["d", None])})["y"]
    assert y.sharding.partial_axes == ()
    assert_comm(log, all_reduce=1)
    assert_sharded_allclose(y, a @ b, rtol=1e-5, atol=1e-5)


def test_output_annotation_moves_the_value():
    relu = annotated(helper.make_node("Relu", ["x"], ["y"], name="relu"), "pair",
                     spec("x", [0, 1], {0: 2}), spec("y", [0, 1], {1: 2}))
    m = model([relu], [("x", F, [4, 6])], [("y", F, [4, 6])], config=("pair", 2))
    x = np.arange(24, dtype=np.float32).reshape(4, 6) - 10
    with nb.comm_log() as log:
        y = nox.run(m, {"x": x})["y"]
    assert_comm(log, all_to_all=1)  # x replicated -> rows is a local slice; rows -> columns one all_to_all
    pair = DeviceMesh("pair", (2,), ("d",))
    assert y.sharding == ShardingSpec(pair, [None, "d"])
    assert_sharded_allclose(y, np.maximum(x, 0))


def test_inputs_and_meshes_are_checked():
    m = model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])], config=("c", 4))
    with pytest.raises(ShardingError, match=r"graph inputs \['x'\] are not given"):
        nox.run(m, {})
    with pytest.raises(ShardingError, match=r"inputs \['z'\] are not graph inputs"):
        nox.run(m, {"x": np.ones(2, np.float32), "z": 1})
    with pytest.raises(ShardingError, match="mesh .* has 2 devices but the model's configurations have"):
        nox.run(m, {"x": np.ones(2, np.float32)}, mesh=MESH)
    y = nox.run(m, {"x": np.ones(2, np.float32)})["y"]
    assert y.mesh == DeviceMesh("c", (4,), ("d",))


def test_abstract_run_gives_shardings_only():
    m = model([helper.make_node("Exp", ["x"], ["y"])], [("x", F, [4, 2])], [("y", F, [4, 2])])
    y = nox.run(m, {"x": nb.abstract((4, 2)).shard(MESH, ["d", None])})["y"]
    assert y.is_abstract and y.sharding.dim_specs[0].axes == ("d",)


def test_gather_host_and_abstract_indices_agree():
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    m = model([helper.make_node("Gather", ["t", "i"], ["y"], axis=0)],
              [("t", F, [5, 4]), ("i", TensorProto.INT64, [2, 3])], [("y", F, [2, 3, 4])])
    ids = np.array([[0, -1, 2], [4, 4, 1]])
    want = table[ids]
    for t in (nb.tensor(table), nb.tensor(table).shard(MESH, ["d", None]), nb.tensor(table).shard(MESH, [None, "d"])):
        got = nox.run(m, {"t": t, "i": ids})["y"]
        assert_sharded_allclose(got, want)
    abstract = nox.run(m, {"t": nb.tensor(table).shard(MESH, ["d", None]), "i": nb.abstract((2, 3), "int64")})["y"]
    assert abstract.shape == (2, 3, 4) and abstract.sharding.partial_axes == ()


DPTP = DeviceMesh("c", (2, 2), ("dp", "tp"))


@pytest.mark.parametrize("table_dims", [None, ["tp", None]], ids=["replicated_table", "table_rows_on_tp"])
def test_gather_keeps_the_ids_sharding_and_logs_every_move(monkeypatch, table_dims):
    """Gather(E, ids) -> Relu with ids on [dp, -]: the indices are never read to the host (a replicated result
    whose data moved outside the log, before); the result keeps the ids' sharding. With E's rows on tp (a node
    annotation), each device looks up the rows it holds and Relu's input is summed over tp: one all_reduce of
    the (B/dp, S, D) block, ring bytes 2(k-1)/k of it."""
    V, D, B, S = 10, 4, 6, 3
    table = np.random.default_rng(1).standard_normal((V, D)).astype(np.float32)
    ids = np.random.default_rng(2).integers(-V, V, (B, S))
    gather = helper.make_node("Gather", ["E", "ids"], ["h"], name="embed")
    if table_dims is not None:  # E's rows in 2 shards, each on a group of devices: tp=0 is {0, 2}, tp=1 {1, 3}
        rows = spec("E", [10, 11], {0: 2})
        for k, v in {10: [0, 2], 11: [1, 3]}.items():
            rows.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=k, value=v))
        gather.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id="c",
                                                                              sharding_spec=[rows]))
    m = model([gather, helper.make_node("Relu", ["h"], ["y"], name="relu")], [("ids", TensorProto.INT64, [B, S])],
              [("y", F, [B, S, D])], inits=[numpy_helper.from_array(table, "E")], config=("c", 4))
    want = np.maximum(table[ids], 0)

    def no_host_reads(self):
        raise AssertionError("a tensor was read to the host while the model ran")

    monkeypatch.setattr(nb.Tensor, "numpy", no_host_reads)
    with nb.comm_log() as log:
        y = nox.run(m, {"ids": nb.tensor(ids).shard(DPTP, ["dp", None])}, mesh=DPTP)["y"]
    monkeypatch.undo()
    assert y.sharding.dim_specs[0].axes == ("dp",) and y.sharding.partial_axes == ()
    if table_dims is None:
        assert log.events == []
    else:
        block = B // 2 * S * D * 4
        assert [(e.kind, e.axes, e.bytes) for e in log.events] == [("all_reduce", ("tp",), 2 * (2 - 1) * block // 2)]
    assert_sharded_allclose(y, want)


@pytest.mark.parametrize("x", [
    np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.7, -3.7, 1e30, -0.0, np.inf, -np.inf, np.nan], np.float32),
    np.array([4.5, -4.5, 1023.5, 2.0 ** 52 + 1, 0.49999999999999994], np.float64),
])
def test_rounding_compositions_are_exact(x):
    for op, ref in (("Floor", np.floor), ("Ceil", np.ceil), ("Round", np.round)):
        m = model([helper.make_node(op, ["x"], ["y"])], [("x", helper.np_dtype_to_tensor_dtype(x.dtype), [len(x)])],
                  [("y", helper.np_dtype_to_tensor_dtype(x.dtype), [len(x)])])
        got = nox.run(m, {"x": nb.tensor(x).shard(MESH, ["d"])})["y"].numpy()
        np.testing.assert_array_equal(got, ref(x), err_msg=op)


def test_transcendental_compositions():
    """Each as numpy's, infinities and large values included (Asinh(-inf), Acosh(inf) and Acosh(1e150) were NaN,
    Atanh(1) NaN where numpy and onnxruntime give inf, when they were compositions)."""
    x = np.linspace(-0.99, 0.99, 41)
    big = np.concatenate([np.linspace(1.0, 30, 20), [1e-8, 1e150, 1e300, np.inf]])
    cases = [("Asin", x, np.arcsin), ("Acos", x, np.arccos), ("Atan", np.concatenate([x * 50, [np.inf, -np.inf]]), np.arctan),
             ("Atanh", np.concatenate([x, [1.0, -1.0]]), np.arctanh), ("Asinh", np.concatenate([-big, big]), np.arcsinh),
             ("Acosh", big[big >= 1], np.arccosh),
             ("Sinh", np.concatenate([x * 1e-6, x * 30]), np.sinh), ("Cosh", x * 30, np.cosh)]
    for op, v, ref in cases:
        m = model([helper.make_node(op, ["x"], ["y"])], [("x", TensorProto.DOUBLE, [len(v)])],
                  [("y", TensorProto.DOUBLE, [len(v)])])
        with np.errstate(divide="ignore"):  # (Atanh(1), as numpy's)
            got = nox.run(m, {"x": v})["y"].numpy()
            np.testing.assert_allclose(got, ref(v), rtol=1e-13, atol=0, err_msg=op)


def test_erf_is_accurate():
    from math import erf
    v = np.concatenate([np.linspace(-6, 6, 241), [1e-12, -1e-9, np.inf, -np.inf]])
    m = model([helper.make_node("Erf", ["x"], ["y"])], [("x", TensorProto.DOUBLE, [len(v)])],
              [("y", TensorProto.DOUBLE, [len(v)])])
    got = nox.run(m, {"x": v})["y"].numpy()
    np.testing.assert_allclose(got, [erf(t) for t in v], rtol=1e-13, atol=1e-15)


def test_arg_reductions_with_nan_and_composite_reductions_over_no_axes_equal_the_onnx_reference():
    """ArgMin of a row holding NaN is the first NaN's index, as ArgMax's (onnx.reference: numpy's); its composition
    with min gave 7, no index of a 7-wide row (and -1 with select_last_index). With noop_with_empty_axes and no axes,
    a composite reduction still runs its elementwise steps (the spec: ReduceSumSquare squares, ReduceLogSum takes
    the log); they returned the input."""
    reference = pytest.importorskip("onnx.reference")
    x = np.float32([[3, 1, np.nan, 0.5, np.nan, 2, 7], [4, -1, 2, 0.5, -1, 2, 7]])
    pos = np.abs(x[1:]) + 0.5
    cases = [("ArgMin", x, {"axis": 1}), ("ArgMin", x, {"axis": 1, "select_last_index": 1}), ("ArgMax", x, {"axis": 1})]
    cases += [(r, pos, {"noop_with_empty_axes": 1}) for r in ("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum",
                                                                "ReduceLogSumExp", "ReduceSum", "ReduceMax", "ReduceProd")]
    for op, v, attrs in cases:
        m = model([helper.make_node(op, ["x"], ["y"], **attrs)], [("x", F, list(v.shape))],
                  [("y", TensorProto.INT64 if op.startswith("Arg") else F, None)])
        want = reference.ReferenceEvaluator(m).run(None, {"x": v})[0]
        got = nox.run(m, {"x": nb.tensor(v).shard(MESH, [None, "d"])})["y"]  # 7 over 2: 4 and 3
        assert_sharded_allclose(got, want)


def test_float_mod_is_cs_fmod_exactly():
    """Mod with fmod=1 is C's fmod, exactly (as onnxruntime's): a - b * trunc(a / b) rounded, 1.0 mod 0.1 in float64
    gave 0 (0.09999999999999995) and 1e300 mod 0.7 gave 0 (0.379...); fmod=0 moves it by b, as numpy's remainder."""
    a = np.array([1.0, 1e7, 1e300, -1e-30, -3.5, 5.0, -7.0, -0.0])
    b = np.array([0.1, 0.3, 0.7, 1.0, 2.0, -3.0, np.inf, 2.0])
    for fmod, want, opset in ((1, np.fmod(a, b), 21), (0, np.remainder(a, b), 28)):
        m = model([helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)],
                  [("a", TensorProto.DOUBLE, [8]), ("b", TensorProto.DOUBLE, [8])], [("y", TensorProto.DOUBLE, [8])],
                  opset=opset)
        got = nox.run(m, {"a": nb.tensor(a).shard(MESH, ["d"]), "b": b})["y"].numpy()
        np.testing.assert_array_equal(got, want)
        assert (np.signbit(got) == np.signbit(want)).all()


def test_einsum_diagonal_and_trace():
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    for eq, args in (("ii->i", (a,)), ("ii", (a,)), ("bii->b", (b,)), ("...ii->...i", (b,)), ("ij,jk", (a, a))):
        ins = [(f"x{i}", F, list(t.shape)) for i, t in enumerate(args)]
        m = model([helper.make_node("Einsum", [n for n, _, _ in ins], ["y"], equation=eq)], ins,
                  [("y", F, None)])
        got = nox.run(m, {f"x{i}": nb.tensor(t).shard(MESH, ["d"] + [None] * (t.ndim - 1))
                          for i, t in enumerate(args)})["y"]
        np.testing.assert_allclose(got.numpy(), np.einsum(eq, *args), err_msg=eq)


def test_bad_annotations_are_reported_before_anything_runs():
    relu = annotated(helper.make_node("Relu", ["x"], ["r"], name="relu"), "pair", spec("x", [0, 1], {0: 2}))
    exp = annotated(helper.make_node("Exp", ["r"], ["y"], name="exp"), "pair", spec("y", [1, 0], {0: 2}))
    m = model([relu, exp], [("x", F, [4, 4])], [("y", F, [4, 4])], config=("pair", 2))
    with nb.comm_log() as log, pytest.raises(ShardingError, match=r"node 'exp' \(Exp\): .* device order \[1, 0\] .* not "
                                                                   r"expressible .* \(nothing was run\)"):
        nox.run(m, {"x": np.ones((4, 4), np.float32)})
    assert log.events == []


def test_numpy_errors_name_the_node():
    m = model([helper.make_node("Pow", ["a", "b"], ["y"], name="pow")],
              [("a", TensorProto.INT64, [2]), ("b", TensorProto.INT64, [2])], [("y", TensorProto.INT64, [2])])
    with pytest.raises(ShardingError, match=r"node 'pow' \(Pow\): Integers to negative integer powers"):
        nox.run(m, {"a": np.array([2, 3]), "b": np.array([1, -1])})


def test_local_functions_are_inlined():
    f = helper.make_function("local", "Double", ["x"], ["y"], [helper.make_node("Add", ["x", "x"], ["y"])],
                             [helper.make_opsetid("", 21)])
    m = model([helper.make_node("Double", ["x"], ["y"], domain="local")], [("x", F, [3])], [("y", F, [3])])
    m.functions.append(f)
    m.opset_import.append(helper.make_opsetid("local", 1))
    np.testing.assert_array_equal(nox.run(m, {"x": np.arange(3, dtype=np.float32)})["y"].numpy(), [0, 2, 4])


def test_backend_entry_points(monkeypatch):
    add = helper.make_node("Add", ["a", "b"], ["c"])
    a, b = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones(2, np.float32)
    (c,) = nox.Backend.run_node(add, [a, b])
    np.testing.assert_array_equal(c, a + b)
    m = model([add], [("a", F, [3, 2]), ("b", F, [2])], [("c", F, [3, 2])])
    assert nox.Backend.is_compatible(m) and nox.Backend.supports_device("CPU")
    rep = nox.Backend.prepare(m, "CPU")
    np.testing.assert_array_equal(rep.run([a, b])[0], a + b)
    np.testing.assert_array_equal(rep.run({"a": a, "b": b})[0], a + b)
    monkeypatch.delitem(OPS, "Det", raising=False)  # an op type nabla.onnx does not run (even once it runs Det)
    assert not nox.Backend.is_compatible(model([helper.make_node("Det", ["a"], ["c"])], [("a", F, [2, 2])], [("c", F, [])]))
    # the placement rule: dim 0 over the 2-device axis when it has at least 2 elements
    from nabla.onnx.backend import shard_input
    assert shard_input(a).sharding.dim_specs[0].axes == ("d",)
    assert shard_input(np.ones((1, 4))).sharding.is_replicated
    assert shard_input(np.float32(3)).sharding.rank == 0


# ---- seed 000's conv group beyond Conv: ConvTranspose, LpNormalization, LpPool, GlobalLpPool ----------------

QUAD = DeviceMesh("q", (4,), ("d",))


def _ort(m, feeds):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("attrs", [dict(strides=[2, 2], pads=[1, 0, 1, 1], output_padding=[1, 0]),
                                   dict(strides=[1, 2], dilations=[2, 1], group=2),
                                   dict(strides=[3, 2], output_shape=[23, 12], auto_pad="SAME_UPPER")],
                         ids=["pads", "groups_dilated", "output_shape"])
def test_conv_transpose_on_every_placement_equals_onnxruntime(attrs):
    """ConvTranspose as the transpose of a conv: rows sharded take halos only (collective_permute), the batch
    nothing, input channels leave partial sums (one all_reduce when the output leaves the graph)."""
    x = np.random.default_rng(0).standard_normal((2, 4, 8, 6)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal(3 * attrs.get("group", 1)).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    m = model([node], [("x", F, list(x.shape)), ("w", F, list(w.shape)), ("b", F, list(b.shape))], [("y", F, None)])
    want = _ort(m, {"x": x, "w": w, "b": b})
    for dims, kinds in (([None, None, "d", None], {"collective_permute"}), (["d", None, None, None], set()),
                        ([None, "d", None, None], {"all_reduce"}), ([None, None, None, "d"], None)):
        with nb.comm_log() as log:
            y = nox.run(m, {"x": nb.tensor(x).shard(QUAD, dims), "w": w, "b": b})["y"]
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
        if kinds is not None:
            assert set(log.counts) <= kinds, (dims, log.counts)
            assert "all_gather" not in log.counts


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_and_lp_pools_on_every_placement(p):
    x = np.random.default_rng(3).standard_normal((2, 3, 9, 8)).astype(np.float32)
    x[0, 0, 0] = 0  # a zero norm gives 0
    nodes = {
        "LpNormalization": helper.make_node("LpNormalization", ["x"], ["y"], axis=1, p=p),
        "LpNormalization_last": helper.make_node("LpNormalization", ["x"], ["y"], axis=-1, p=p),
        "LpPool": helper.make_node("LpPool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1], p=p),
        "GlobalLpPool": helper.make_node("GlobalLpPool", ["x"], ["y"], p=p),
    }
    for name, node in nodes.items():
        m = model([node], [("x", F, list(x.shape))], [("y", F, None)])
        want = _ort(m, {"x": x})
        for dims in ([None] * 4, ["d", None, None, None], [None, "d", None, None], [None, None, "d", None],
                     [None, None, None, "d"]):
            with nb.comm_log() as log:
                y = nox.run(m, {"x": nb.tensor(x).shard(QUAD, dims)})["y"]
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {dims}")
            if name == "LpPool" and dims[2]:
                assert set(log.counts) <= {"collective_permute"}, log.counts  # halo rows only


def test_inputs_must_have_the_declared_shape():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, "n"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    g = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    assert nox.run(model, {"x": np.ones((8, 3), np.float32)})["y"].shape == (8, 3)  # a named dim takes any size
    for bad in (np.ones((3, 3), np.float32), np.ones((8,), np.float32)):
        with pytest.raises(nb.ShardingError, match=r"input 'x' has shape .* but the graph declares \(8, 'n'\)"):
            nox.run(model, {"x": bad})


def test_a_registered_op_naming_an_onnx_type_runs_its_nodes_before_the_table():
    """One registration serves export and import: an op registered as ONNX's Softsign runs Softsign nodes (its one
    kernel step), and the table's composition again once it is unregistered; both equal onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    from nabla.ops import elementwise, unregister
    m = model([helper.make_node("Softsign", ["x"], ["y"], name="s")], [("x", F, [4, 6])], [("y", F, [4, 6])])
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    xs = nb.tensor(x).shard(MESH, ["d", None])
    elementwise("test_softsign", lambda xp, v: v / (1 + xp.abs(v)), onnx="Softsign", public=False)
    try:
        with nb.comm_log() as log:
            got = nox.run(m, {"x": xs})["y"]
        assert [s.name for s in log.steps] == ["test_softsign"]
        assert_sharded_allclose(got, want, rtol=1e-6)
    finally:
        unregister("test_softsign")
    with nb.comm_log() as log:
        got = nox.run(m, {"x": xs})["y"]
    assert "test_softsign" not in [s.name for s in log.steps] and len(log.steps) > 1  # the table's abs, add, divide
    assert_sharded_allclose(got, want, rtol=1e-6)


def test_an_exported_stop_gradient_reads_back_as_identity():
    """ONNX has no stop-gradient: nb.stop_gradient exports as Identity, and an Identity node imports as the value
    itself, not as a stop of gradients."""
    assert nox.ops.entry("Identity", 1) is OPS["Identity"]
    m = nox.export(lambda x: nb.stop_gradient(x) * 2.0, nb.tensor(np.ones((2, 3), np.float32)))
    assert [n.op_type for n in m.graph.node if n.op_type != "Constant"] == ["Identity", "Mul"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with nb.comm_log() as log:
        got = nox.run(m, {m.graph.input[0].name: x})
    assert [s.name for s in log.steps] == ["multiply"]
    np.testing.assert_array_equal(np.asarray(next(iter(got.values()))), x * 2)
