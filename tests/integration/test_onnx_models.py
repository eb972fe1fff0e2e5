"""Small hand-built ONNX models run on sharded inputs, compared with onnxruntime; annotation round trips."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import nabla as nb  # noqa: E402
import nabla.onnx as nox  # noqa: E402
from nabla import DeviceMesh, ShardingSpec  # noqa: E402
from nabla.testing import assert_comm, assert_sharded_allclose  # noqa: E402

F = TensorProto.FLOAT
MESH = DeviceMesh("cluster", (2, 2), ("dp", "tp"))
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def spec(name, devices, dims):
    p = onnx.ShardingSpecProto(tensor_name=name, device=devices)
    for axis, n in dims.items():
        p.sharded_dim.append(onnx.ShardedDimProto(axis=axis, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=n)]))
    return p


def mlp():
    """x[8,16] -> Gemm(W1, b1) -> Relu -> Gemm(W2^T, b2) -> Softmax."""
    inits = [numpy_helper.from_array(rand(16, 32), "W1"), numpy_helper.from_array(rand(32), "b1"),
             numpy_helper.from_array(rand(4, 32), "W2"), numpy_helper.from_array(rand(4), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["z"], name="fc2", transB=1, alpha=0.5),
             helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, [8, 16])],
                          [helper.make_tensor_value_info("y", F, [8, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def attention():
    """x[B=2, S=4, D=8], two heads: q, k, v projections, Reshape/Transpose to heads, softmax(q k^T / sqrt(dh)) v,
    back to [B, S, D] and an output projection."""
    B, S, D, H = 2, 4, 8, 2
    inits = [numpy_helper.from_array(rand(D, D), n) for n in ("Wq", "Wk", "Wv", "Wo")]
    inits += [numpy_helper.from_array(np.array([B, S, H, D // H], np.int64), "heads"),
              numpy_helper.from_array(np.array([B, S, D], np.int64), "merged")]
    nodes = []
    for p in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"W{p}"], [f"{p}0"], name=f"proj_{p}"),
                  helper.make_node("Reshape", [f"{p}0", "heads"], [f"{p}1"], name=f"split_{p}"),
                  helper.make_node("Transpose", [f"{p}1"], [f"{p}2"], name=f"heads_{p}", perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Transpose", ["k2"], ["kT"], name="kT", perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q2", "kT"], ["s0"], name="scores"),
              helper.make_node("Constant", [], ["scale"], name="scale",
                               value=numpy_helper.from_array(np.array(1 / np.sqrt(D // H), np.float32))),
              helper.make_node("Mul", ["s0", "scale"], ["s1"], name="scaled"),
              helper.make_node("Softmax", ["s1"], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "v2"], ["o0"], name="mix"),
              helper.make_node("Transpose", ["o0"], ["o1"], name="unheads", perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o1", "merged"], ["o2"], name="merge"),
              helper.make_node("MatMul", ["o2", "Wo"], ["y"], name="proj_o")]
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info("x", F, [B, S, D])],
                          [helper.make_tensor_value_info("y", F, [B, S, D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("dims", [["dp", None], [None, "tp"], ["dp", "tp"], [("dp", "tp"), None], [None, None]])
def test_mlp_matches_onnxruntime(dims):
    m = mlp()
    x = rand(8, 16)
    want = ort_run(m, {"x": x})["y"]
    got = nox.run(m, {"x": nb.tensor(x).shard(MESH, dims)})["y"]
    assert not got.sharding.partial_axes
    assert_sharded_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mlp_megatron_annotations_need_one_all_reduce():
    m = mlp()
    cfg = "cluster"
    m.configuration.append(onnx.DeviceConfigurationProto(name=cfg, num_devices=4))
    # W1 column-parallel and W2 (stored [out, in]) row-parallel over tp; devices of tp groups: {0,2}, {1,3}
    col = onnx.ShardingSpecProto(tensor_name="W1", device=[-1, -2], sharded_dim=[onnx.ShardedDimProto(
        axis=1, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=2)])],
        index_to_device_group_map=[onnx.IntIntListEntryProto(key=-1, value=[0, 2]),
                                   onnx.IntIntListEntryProto(key=-2, value=[1, 3])])
    row = onnx.ShardingSpecProto()
    row.CopyFrom(col)
    row.tensor_name = "W2"
    m.graph.node[0].device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=cfg, sharding_spec=[col]))
    m.graph.node[2].device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=cfg, sharding_spec=[row]))
    assert nox.spec_from_onnx(col, MESH, 2) == ShardingSpec(MESH, [None, "tp"])
    x = rand(8, 16)
    want = ort_run(m, {"x": x})["y"]
    with nb.comm_log() as log:
        got = nox.run(m, {"x": nb.tensor(x).shard(MESH, ["dp", None])}, mesh=MESH)["y"]
    assert_comm(log, all_reduce=1)
    assert_sharded_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", [["dp", None, None], [None, None, "tp"], ["dp", None, "tp"], [None, "tp", None]])
def test_attention_matches_onnxruntime(dims):
    m = attention()
    x = rand(2, 4, 8)
    want = ort_run(m, {"x": x})["y"]
    got = nox.run(m, {"x": nb.tensor(x).shard(MESH, dims)})["y"]
    assert got.sharding is not None and not got.sharding.partial_axes
    assert_sharded_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_mesh_from_the_configuration_and_annotations_as_with_sharding():
    m = mlp()
    m.configuration.append(onnx.DeviceConfigurationProto(name="pair", num_devices=2))
    m.graph.node[0].device_configurations.append(onnx.NodeDeviceConfigurationProto(
        configuration_id="pair", sharding_spec=[spec("x", [0, 1], {0: 2}), spec("h", [0, 1], {1: 2})]))
    x = rand(8, 16)
    with nb.comm_log() as log:
        out = nox.run(m, {"x": x})
    y = out["y"]
    assert y.mesh == DeviceMesh("pair", (2,), ("d",))
    # x: replicated -> rows (a local slice); h: rows -> columns (one all_to_all); softmax over columns
    assert log.counts.get("all_to_all") == 1
    assert_sharded_allclose(y, ort_run(m, {"x": x})["y"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build, shardings", [
    (mlp, {"x": ["dp", None]}),
    (mlp, {"x": [None, "tp"]}),
    (attention, {"x": ["dp", None, "tp"]}),
])
def test_annotation_round_trip(build, shardings):
    m = build()
    a = nox.annotate(m, MESH, shardings)
    onnx.checker.check_model(a)
    nox.check(a)
    # every node input and output carries a spec for the mesh's configuration
    for n in a.graph.node:
        named = {s.tensor_name for c in n.device_configurations for s in c.sharding_spec}
        assert named == {t for t in list(n.input) + list(n.output) if t}
    # annotating again changes nothing
    assert nox.annotate(a, MESH, shardings).SerializeToString() == a.SerializeToString()
    # running the annotated model gives onnxruntime's values, with the annotated output spec
    x = rand(*[d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim])
    want = ort_run(a, {"x": x})
    xin = nb.tensor(x).shard(MESH, shardings["x"])
    got = nox.run(a, {"x": xin}, mesh=MESH)
    last = a.graph.node[-1]
    out_spec = next(s for s in last.device_configurations[0].sharding_spec if s.tensor_name == last.output[0])
    y = got[last.output[0]]
    assert y.sharding.layout() == nox.spec_from_onnx(out_spec, MESH, y.ndim)
    assert_sharded_allclose(y, want[last.output[0]], rtol=1e-4, atol=1e-5)
    # on the 1-D mesh the configuration describes (mesh=None), the same shards on the same devices
    flat = nox.run(a, {"x": x})[last.output[0]]
    assert flat.mesh.shape == (4,)
    for d in range(4):
        assert flat.sharding.shard_slices(y.shape, d) == y.sharding.shard_slices(y.shape, d)
    np.testing.assert_allclose(flat.numpy(), want[last.output[0]], rtol=1e-4, atol=1e-5)


def test_annotate_reads_nabla_propagation():
    a = nox.annotate(mlp(), MESH, {"x": [None, "tp"]})
    specs = {s.tensor_name: nox.spec_from_onnx(s, MESH, 1 if s.tensor_name.startswith("b") else 2)
             for s in a.graph.node[0].device_configurations[0].sharding_spec}
    # x's contracted dim is sharded on tp, so W1 is cut on its rows (a local slice) and h's sum is made
    assert specs["x"] == ShardingSpec(MESH, [None, "tp"])
    assert specs["W1"] == ShardingSpec(MESH, ["tp", None])
    assert specs["h"] == ShardingSpec(MESH, [None, None])


def test_vocab_parallel_embedding_annotation():
    """Gather with data-dependent (abstract) indices on a vocab-sharded table: partial sums, then reduced."""
    table = numpy_helper.from_array(rand(10, 4), "E")
    g = helper.make_graph([helper.make_node("Gather", ["E", "ids"], ["h"], name="embed")], "emb",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 5])],
                          [helper.make_tensor_value_info("h", F, [3, 5, 4])], [table])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.configuration.append(onnx.DeviceConfigurationProto(name="cluster", num_devices=4))
    m.graph.node[0].device_configurations.append(onnx.NodeDeviceConfigurationProto(
        configuration_id="cluster", sharding_spec=[spec("E", [0, 1, 2, 3], {0: 4})]))
    a = nox.annotate(m, MESH, {"ids": ["dp", None]})
    nox.check(a)
    ids = RNG.integers(-10, 10, (3, 5))
    want = ort_run(m, {"ids": ids})["h"]
    got = nox.run(a, {"ids": nb.tensor(ids).shard(MESH, ["dp", None])}, mesh=MESH)["h"]
    assert_sharded_allclose(got, want)


def _one_node(op, opset, inputs, n_out=1, **attrs):
    names = [f"i{k}" for k in range(len(inputs))]
    outs = [f"o{k}" for k in range(n_out)]
    g = helper.make_graph([helper.make_node(op, names, outs, **attrs)], op,
                          [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                           for n, v in zip(names, inputs)],
                          [helper.make_empty_tensor_value_info(o) for o in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    return m, dict(zip(names, inputs))


X3 = rand(4, 3, 5)
OLD_OPSETS = [
    ("Softmax", 11, [X3], 1, {"axis": 1}),  # before 13: softmax over the flattened dims from axis
    ("LogSoftmax", 11, [X3], 1, {}),
    ("Hardmax", 11, [X3], 1, {"axis": 2}),
    ("Split", 11, [X3], 2, {"axis": 2, "split": [2, 3]}),
    ("Split", 13, [X3], 2, {}),
    ("Slice", 9, [X3], 1, {"starts": [1, -4], "ends": [100, -1], "axes": [0, 2]}),
    ("Pad", 10, [X3], 1, {"pads": [0, 1, 2, 1, 0, 0], "mode": "reflect"}),
    ("Pad", 10, [X3], 1, {"pads": [1, 0, 0, 0, 2, 3], "value": 1.5}),
    ("ReduceSum", 11, [X3], 1, {"axes": [0, 2], "keepdims": 0}),
    ("ReduceMean", 13, [X3], 1, {"axes": [-1]}),
    ("ReduceMax", 13, [X3], 1, {}),
    ("Squeeze", 11, [rand(4, 1, 5)], 1, {"axes": [1]}),
    ("Unsqueeze", 11, [X3], 1, {"axes": [0, -1]}),
    ("Clip", 6, [X3], 1, {"min": -0.5, "max": 0.25}),
    ("Dropout", 10, [X3], 1, {"ratio": 0.3}),  # (onnxruntime's opset-10 mask is all False, ONNX's reference all True)
    ("Flatten", 11, [X3], 1, {"axis": 0}),
    ("ArgMin", 11, [X3], 1, {"axis": 1, "keepdims": 0}),
]


@pytest.mark.parametrize("op, opset, inputs, n_out, attrs", OLD_OPSETS, ids=lambda v: str(v) if isinstance(v, (str, int)) else "")
def test_older_opsets_match_onnxruntime(op, opset, inputs, n_out, attrs):
    m, feeds = _one_node(op, opset, inputs, n_out, **attrs)
    want = ort_run(m, feeds)
    got = nox.run(m, {k: nb.tensor(v).shard(MESH, ["dp"] + [None] * (v.ndim - 1)) for k, v in feeds.items()})
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name].numpy(), value, rtol=1e-5, atol=1e-6)


# ---- real models: onnx's light CNNs with random weights, on a 4-device mesh ----------------------------------
#
# CI runs two of them at a reduced input size; NABLA_ALL_MODELS=1 runs all nine at their 224x224 input.

import functools  # noqa: E402
import os  # noqa: E402

from nabla.onnx import graph, zoo  # noqa: E402

ALL_MODELS = os.environ.get("NABLA_ALL_MODELS") == "1"
LIGHT = [(name, None) for name in zoo.LIGHT_MODELS] if ALL_MODELS else [("resnet50", 64), ("squeezenet", 64)]
QUAD = DeviceMesh("quad", (4,), ("d",))
WINDOWED = ("Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "LRN")


@functools.lru_cache(maxsize=None)
def light(name, size):
    """The model (random weights, logits out), an input image and onnxruntime's logits."""
    m = zoo.light_model(name, seed=0, size=size)
    dims = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).standard_normal(dims).astype(np.float32)
    want = ort_run(m, {m.graph.input[0].name: x})[m.graph.output[0].name]
    return m, x, want


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def ids(case):
    return f"{case[0]}@{case[1] or 224}"


@pytest.mark.parametrize("case", LIGHT, ids=ids)
def test_light_model_with_image_rows_sharded(case):
    """Spatial partitioning: the image's rows split over 4 devices stay split through every conv and pool,
    each device receiving only its halo rows (collective_permute), never a gather of the rows."""
    m, x, want = light(*case)
    inp, out = m.graph.input[0].name, m.graph.output[0].name
    with nb.comm_log() as log:
        got = nox.run(m, {inp: nb.tensor(x).shard(QUAD, [None, None, "d", None])})[out]
    assert not got.sharding.partial_axes
    assert rel_err(got.numpy(), want) < 1e-4
    windowed = [e for e in log.events if e.op.split(" ")[0] in WINDOWED]
    assert windowed and {e.kind for e in windowed} == {"collective_permute"}
    # per windowed node, the halo rows cost less than gathering the rows of its input would
    shapes = zoo.shapes(m)
    node_input = {f"{n.op_type} {n.name}": n.input[0] for n in m.graph.node}
    halo: dict[str, int] = {}
    for e in windowed:
        halo[e.op] = halo.get(e.op, 0) + e.bytes
    for op, sent in halo.items():
        shape = shapes[node_input[op]]
        block = -(-shape[2] // 4) * int(np.prod(shape)) // shape[2] * 4  # a device's rows, in bytes
        gather = 3 * block  # all_gather over 4 devices: (k-1) blocks sent per device
        assert sent < gather, (op, sent, gather)


@pytest.mark.parametrize("case", LIGHT, ids=ids)
def test_light_model_with_channels_sharded(case):
    """Channel (tensor) parallelism: the image split on its channels and every conv's output annotated as
    split over its channels; a conv contracts its split input channels into partial sums, which its output
    annotation turns into one reduce_scatter."""
    m, x, want = light(*case)
    inp, out = m.graph.input[0].name, m.graph.output[0].name
    mc = zoo.shard_channels(m, 4, config=QUAD.name)
    with nb.comm_log() as log:
        got = nox.run(mc, {inp: nb.tensor(x).shard(QUAD, [None, "d", None, None])}, mesh=QUAD)[out]
    assert not got.sharding.partial_axes
    assert rel_err(got.numpy(), want) < 1e-4
    if case[0] in ("resnet50", "squeezenet"):  # ungrouped convs, each fed channel-split activations
        n_conv = sum(n.op_type == "Conv" for n in m.graph.node)
        conv_events = [e for e in log.events if e.op.startswith("Conv")]
        assert [e.kind for e in conv_events] == ["reduce_scatter"] * n_conv
        assert "all_gather" not in log.counts


@pytest.mark.parametrize("case", LIGHT[-1:], ids=ids)
def test_light_model_exported_back_with_its_shardings(case):
    """ONNX -> nabla (rows sharded) -> nox.export: the exported graph runs on onnxruntime to the original's
    logits, every node carries the layout nabla chose, and nabla reruns it with the same collectives."""
    m, x, want = light(*case)
    inp, out = m.graph.input[0].name, m.graph.output[0].name
    xs = nb.tensor(x).shard(QUAD, [None, None, "d", None])
    with nb.comm_log() as first:
        e = nox.export(lambda image: nox.run(m, {inp: image})[out], xs)
    assert rel_err(ort_run(e, {"image": x})["output"], want) < 1e-4
    assert all(n.device_configurations for n in e.graph.node)
    conv = next(n for n in e.graph.node if n.op_type == "Conv")
    (spec_x,) = [s for s in conv.device_configurations[0].sharding_spec if s.tensor_name == conv.input[0]]
    assert nox.spec_from_onnx(spec_x, QUAD, 4) == ShardingSpec(QUAD, [None, None, "d", None])
    with nb.comm_log() as again:
        got = nox.run(e, {"image": xs}, mesh=QUAD)["output"]
    assert rel_err(got.numpy(), want) < 1e-4
    assert again.counts == first.counts


def conv_bn(shared=False, bias=True):
    """x -> Conv(W, b) -> BatchNormalization -> Relu; with ``shared`` the conv's output is also a graph output."""
    C, O = 3, 4
    inits = [numpy_helper.from_array(rand(O, C, 3, 3), "W"), numpy_helper.from_array(rand(O), "scale"),
             numpy_helper.from_array(rand(O), "shift"), numpy_helper.from_array(rand(O), "mean"),
             numpy_helper.from_array(np.abs(rand(O)) + 0.5, "var")]
    if bias:
        inits.append(numpy_helper.from_array(rand(O), "b"))
    nodes = [helper.make_node("Conv", ["x", "W", "b"] if bias else ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"], name="bn",
                              epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"], name="relu")]
    outs = [helper.make_tensor_value_info("y", F, [2, O, 8, 8])]
    if shared:
        outs.append(helper.make_tensor_value_info("c", F, [2, O, 8, 8]))
    g = helper.make_graph(nodes, "conv_bn", [helper.make_tensor_value_info("x", F, [2, C, 8, 8])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("shared, bias", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("dims", [[None, None, None, None], [None, None, "dp", "tp"], [None, "dp", None, None]])
def test_conv_batch_norm_folding(shared, bias, dims):
    """nox.run folds an inference BatchNormalization into the conv before it (as onnxruntime does): the
    activations take one pass for the bias instead of three; values and layouts are unchanged, and a conv
    output that something else reads is not folded."""
    from nabla.onnx.fuse import foldable
    m = conv_bn(shared, bias)
    before = m.SerializeToString()
    assert len(foldable(m)) == (0 if shared else 1)
    assert not foldable(m, given={"W"})  # a weight the caller feeds is not a constant
    x = rand(2, 3, 8, 8)
    want = ort_run(m, {"x": x})
    got = nox.run(m, {"x": nb.tensor(x).shard(MESH, dims)})
    for name, value in want.items():
        np.testing.assert_allclose(got[name].numpy(), value, rtol=1e-4, atol=1e-5)
    assert m.SerializeToString() == before  # the model is not modified
    # the annotations of both nodes still act: the norm's output split over its channels
    m.configuration.append(onnx.DeviceConfigurationProto(name="cluster", num_devices=4))
    m.graph.node[1].device_configurations.append(onnx.NodeDeviceConfigurationProto(
        configuration_id="cluster", sharding_spec=[spec("n", [0, 1, 2, 3], {1: 4}), spec("scale", [0, 1, 2, 3], {0: 4})]))
    a = nox.run(m, {"x": nb.tensor(x).shard(MESH, dims)}, mesh=MESH)
    np.testing.assert_allclose(a["y"].numpy(), want["y"], rtol=1e-4, atol=1e-5)
    assert a["y"].sharding.layout() == ShardingSpec(MESH, [None, ("dp", "tp"), None, None])


def residual_block(shortcut: str, swap: bool, op: str = "Add"):
    """x -> Conv -> BN -> Relu -> Conv -> BN, added to the shortcut (x itself, or a 1x1 conv of x made before
    or after the branch), then Relu; ``swap`` puts the shortcut first in the Add."""
    C = 4
    inits = [numpy_helper.from_array(rand(C, C, 3, 3), "Wa"), numpy_helper.from_array(rand(C, C, 3, 3), "Wb"),
             numpy_helper.from_array(rand(C, C, 1, 1), "Wp"), numpy_helper.from_array(rand(C), "bp")]
    for p in "ab":
        inits += [numpy_helper.from_array(rand(C), f"s{p}"), numpy_helper.from_array(rand(C), f"t{p}"),
                  numpy_helper.from_array(rand(C), f"m{p}"), numpy_helper.from_array(np.abs(rand(C)) + 0.5, f"v{p}")]
    branch = [helper.make_node("Conv", ["x", "Wa"], ["ca"], pads=[1, 1, 1, 1]),
              helper.make_node("BatchNormalization", ["ca", "sa", "ta", "ma", "va"], ["na"]),
              helper.make_node("Relu", ["na"], ["ra"]),
              helper.make_node("Conv", ["ra", "Wb"], ["cb"], pads=[1, 1, 1, 1]),
              helper.make_node("BatchNormalization", ["cb", "sb", "tb", "mb", "vb"], ["nb"])]
    proj = [helper.make_node("Conv", ["x", "Wp", "bp"], ["p"])]
    nodes = {"identity": branch, "conv first": proj + branch, "conv last": branch + proj}[shortcut]
    ins = ["x" if shortcut == "identity" else "p", "nb"]
    nodes += [helper.make_node(op, ins[::-1] if swap else ins, ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    outs = [helper.make_tensor_value_info("y", F, [2, C, 8, 8])]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", F, [2, C, 8, 8])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("shortcut", ["identity", "conv first", "conv last"])
@pytest.mark.parametrize("swap, op", [(False, "Add"), (True, "Add"), (False, "Sum")])
@pytest.mark.parametrize("dims", [[None, None, None, None], ["dp", None, "tp", None], [None, None, ("dp", "tp"), None]],
                         ids=str)
def test_residual_add_and_relu_run_in_the_conv_kernel(shortcut, swap, op, dims):
    """A ResNet block's Add and Relu run in the kernel of the conv that feeds them last (the other operand is
    made by then): the result and every collective are the unfused run's (the sum also a graph output)."""
    from nabla.onnx import graph
    x = rand(2, 4, 8, 8)
    m = residual_block(shortcut, swap, op)
    want = ort_run(m, {"x": x})["y"]
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph, "apply", lambda op, args: calls.append(op) or nb.ops.apply(op, args))
        with nb.comm_log() as fused:
            got = nox.run(m, {"x": nb.tensor(x).shard(MESH, dims)})["y"]
    assert not calls  # no separate Add + Relu
    plain_model = onnx.ModelProto()
    plain_model.CopyFrom(m)  # the sum also a graph output: nothing fuses with the Relu
    plain_model.graph.output.append(helper.make_tensor_value_info("s", F, [2, 4, 8, 8]))
    with nb.comm_log() as plain:
        ref = nox.run(plain_model, {"x": nb.tensor(x).shard(MESH, dims)})["y"]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got.numpy(), ref.numpy())
    assert [(e.kind, e.bytes) for e in fused.events] == [(e.kind, e.bytes) for e in plain.events]
    assert got.sharding == ref.sharding


@pytest.mark.parametrize("case", LIGHT, ids=ids)
def test_annotate_writes_only_what_check_accepts_and_runs_as_onnxruntime(case):
    """Rows sharded over 4 devices shrink below 4 deep in the network (64 x 64 input: 2 rows at resnet's last
    stage, 3 after squeezenet's pools); annotate writes those tensors on the largest sub-axis that fits (d:(1)2),
    not 4 shards of which some hold nothing, so nox.check accepts its own output; the annotated model runs to
    onnxruntime's logits."""
    m, x, want = light(*case)
    inp, out = m.graph.input[0].name, m.graph.output[0].name
    a = nox.annotate(m, QUAD, {inp: [None, None, "d", None]})
    nox.check(a)
    got = nox.run(a, {inp: nb.tensor(x).shard(QUAD, [None, None, "d", None])}, mesh=QUAD)[out]
    assert rel_err(got.numpy(), want) < 1e-4
    specs = [s for n in a.graph.node for c in n.device_configurations for s in c.sharding_spec]
    assert any(len(d.simple_sharding) and d.simple_sharding[0].num_shards == 2 for s in specs for d in s.sharded_dim)
    with pytest.raises(nb.ShardingError, match=rf"annotate: input '{inp}' dim 0 of size 1 is split in 4 shards"):
        nox.annotate(m, QUAD, {inp: ["d", None, None, None]})


def test_a_prepared_model_keeps_its_placed_weights_for_the_next_run(monkeypatch):
    """``nox.Backend.prepare(model, mesh=...)`` is a session, as onnxruntime's: the second run places no
    initializer and folds no norm again, and its values equal onnxruntime's as the first run's do."""

    m, x, want = light("resnet50", 64)
    rep = nox.Backend.prepare(m, mesh=QUAD)
    xr = nb.tensor(x).shard(QUAD, [None, None, "d", None])
    placed = []
    place = graph.Walker.place_initializer
    monkeypatch.setattr(graph.Walker, "place_initializer", lambda self, v: placed.append(1) or place(self, v))
    with nb.comm_log() as first:
        (a,) = rep.run([xr])
    n = len(placed)
    with nb.comm_log() as second:
        (b,) = rep.run([xr])
    assert n > 100 and len(placed) == n  # (ResNet-50's weights and folded conv/norm pairs, each placed once)
    assert rel_err(a, want) < 1e-4 and np.array_equal(a, b)
    assert [(e.kind, e.bytes) for e in first.events] == [(e.kind, e.bytes) for e in second.events]
