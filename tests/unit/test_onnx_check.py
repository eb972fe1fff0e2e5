"""nox.check: seed 001's validity rules per op group, with errors that name node, tensor, dim and rule."""

import pytest

onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

import nabla.onnx as nox  # noqa: E402
from nabla import DeviceMesh, ShardingError  # noqa: E402
from nabla.onnx.ops import OPS  # noqa: E402

F = TensorProto.FLOAT


def spec(name, devices, dims, groups=None):
    p = onnx.ShardingSpecProto(tensor_name=name, device=devices)
    for axis, n in dims.items():
        p.sharded_dim.append(onnx.ShardedDimProto(axis=axis, simple_sharding=[onnx.SimpleShardedDimProto(num_shards=n)]))
    for k, v in (groups or {}).items():
        p.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=k, value=v))
    return p


def node(op, ins, outs, name, specs=(), config="cfg", **attrs):
    n = helper.make_node(op, ins, outs, name=name, **attrs)
    if specs:
        n.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=config, sharding_spec=list(specs)))
    return n


def model(nodes, inputs, outputs, num_devices=2, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, s) for n, s in outputs], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.configuration.append(onnx.DeviceConfigurationProto(name="cfg", num_devices=num_devices))
    return m


def seed_add(b_axis):
    """Seed 001's example: Add of two [32, 1024] tensors, A split on axis 0, B on axis ``b_axis``."""
    return model([node("Add", ["A", "B"], ["C"], "add", [spec("A", [0, 1], {0: 2}), spec("B", [0, 1], {b_axis: 2})])],
                 [("A", [32, 1024]), ("B", [32, 1024])], [("C", [32, 1024])])


def test_seed_001_nonsense_add_is_rejected():
    with pytest.raises(ShardingError) as e:
        nox.check(seed_add(1))
    msg = str(e.value)
    assert "node 'add' (Add)" in msg
    assert "tensor 'B' dim 0" in msg and "tensor 'A' dim 0" in msg
    assert "broadcast n-ary" in msg and "sharded identically" in msg


def test_seed_001_consistent_add_is_valid():
    assert nox.check(seed_add(0)) is None


def test_seed_001_composition_of_broadcast_axes_is_valid():
    m = model([node("Add", ["X", "Y"], ["Z"], "add", [
        spec("X", [-1, -2], {0: 2}, {-1: [0, 1], -2: [2, 3]}),
        spec("Y", [-1, -2], {1: 2}, {-1: [0, 2], -2: [1, 3]}),
        spec("Z", [0, 1, 2, 3], {0: 2, 1: 2})])],
        [("X", [8, 1]), ("Y", [1, 6])], [("Z", [8, 6])], num_devices=4)
    nox.check(m)


def test_sharded_size_one_broadcast_dim_is_rejected():
    m = model([node("Add", ["X", "Y"], ["Z"], "add", [spec("Y", [0, 1], {0: 2})])],
              [("X", [8, 6]), ("Y", [1, 6])], [("Z", [8, 6])])
    with pytest.raises(ShardingError, match=r"tensor 'Y' dim 0 has size 1 .* size-1 broadcast dim must be replicated"):
        nox.check(m)


def test_inherited_specs_are_checked_too():
    # no annotation on the Add: its inputs keep the shardings their producers gave them
    m = model([node("Relu", ["A"], ["a"], "r1", [spec("a", [0, 1], {0: 2})]),
               node("Relu", ["B"], ["b"], "r2", [spec("b", [0, 1], {1: 2})]),
               node("Add", ["a", "b"], ["C"], "add")],
              [("A", [4, 6]), ("B", [4, 6])], [("C", [4, 6])])
    with pytest.raises(ShardingError, match=r"node 'add' \(Add\): tensor 'b' dim 0 is replicated but tensor 'a' dim 0"):
        nox.check(m)


def test_model_inputs_are_unsharded_by_default():
    # A is replicated (a model input), B is annotated on dim 0: the Add's operands disagree
    m = model([node("Add", ["A", "B"], ["C"], "add", [spec("B", [0, 1], {0: 2})])],
              [("A", [4, 6]), ("B", [4, 6])], [("C", [4, 6])])
    with pytest.raises(ShardingError, match="tensor 'B' dim 0 is sharded"):
        nox.check(m)


def test_unary_and_reduction_take_any_input_sharding():
    m = model([node("Exp", ["A"], ["e"], "exp", [spec("A", [0, 1], {1: 2}), spec("e", [0, 1], {0: 2})]),
               node("ReduceSum", ["e"], ["s"], "sum", [spec("e", [0, 1], {1: 2})], keepdims=0)],
              [("A", [4, 6])], [("s", [4])])
    nox.check(m)


def test_matmul_needs_the_same_k_sharding():
    ok = model([node("MatMul", ["A", "B"], ["C"], "mm", [spec("A", [0, 1], {1: 2}), spec("B", [0, 1], {0: 2})])],
               [("A", [4, 6]), ("B", [6, 8])], [("C", [4, 8])])
    nox.check(ok)
    bad = model([node("MatMul", ["A", "B"], ["C"], "mm", [spec("A", [0, 1], {1: 2})])],
                [("A", [4, 6]), ("B", [6, 8])], [("C", [4, 8])])
    with pytest.raises(ShardingError, match=r"node 'mm' \(MatMul\): the contracted dim K is sharded .* tensor 'A' \(dim 1\) "
                                            r"but replicated on tensor 'B' \(dim 0\)"):
        nox.check(bad)


def test_gemm_transposed_k_and_bias():
    k = [spec("A", [0, 1], {1: 2}), spec("B", [0, 1], {1: 2})]  # B is [N, K] with transB
    nox.check(model([node("Gemm", ["A", "B"], ["C"], "g", k, transB=1)],
                    [("A", [4, 6]), ("B", [8, 6])], [("C", [4, 8])]))
    with pytest.raises(ShardingError, match="contracted dim K"):
        nox.check(model([node("Gemm", ["A", "B"], ["C"], "g", k)], [("A", [4, 6]), ("B", [6, 8])], [("C", [4, 8])]))
    bias = [spec("A", [0, 1], {0: 2}), spec("c", [0, 1], {0: 2})]  # C [N] sharded while N is not
    with pytest.raises(ShardingError, match=r"tensor 'c' dim 0 is sharded .* Gemm's C"):
        nox.check(model([node("Gemm", ["A", "B", "c"], ["C"], "g", bias)],
                        [("A", [4, 6]), ("B", [6, 8]), ("c", [8])], [("C", [4, 8])]))


def test_einsum_letters_sharded_identically():
    ok = [spec("A", [0, 1], {1: 2}), spec("B", [0, 1], {0: 2})]
    nox.check(model([node("Einsum", ["A", "B"], ["C"], "es", ok, equation="ij,jk->ik")],
                    [("A", [4, 6]), ("B", [6, 8])], [("C", [4, 8])]))
    bad = [spec("A", [0, 1], {1: 2})]
    with pytest.raises(ShardingError, match=r"letter 'j' is replicated on tensor 'B' dim 0"):
        nox.check(model([node("Einsum", ["A", "B"], ["C"], "es", bad, equation="ij,jk->ik")],
                        [("A", [4, 6]), ("B", [6, 8])], [("C", [4, 8])]))


def test_devices_and_shard_counts_out_of_range():
    m = model([node("Relu", ["A"], ["B"], "r", [spec("A", [0, 5], {0: 2})])], [("A", [4, 6])], [("B", [4, 6])])
    with pytest.raises(ShardingError, match=r"node 'r' \(Relu\): .*device 5 .* not a device of mesh"):
        nox.check(m)
    m = model([node("Relu", ["A"], ["B"], "r", [spec("A", [0, 1], {2: 2})])], [("A", [4, 6])], [("B", [4, 6])])
    with pytest.raises(ShardingError, match="axis 2 is out of range for rank 2"):
        nox.check(m)
    m = model([node("Relu", ["A"], ["B"], "r", [spec("A", [0, 1, 2, 3], {0: 4})])], [("A", [2, 6])], [("B", [2, 6])],
              num_devices=4)
    with pytest.raises(ShardingError, match="tensor 'A' dim 0 of size 2 is split in 4 shards"):
        nox.check(m)


def test_annotations_must_name_the_node_tensors_and_a_configuration():
    m = model([node("Relu", ["A"], ["B"], "r", [spec("Q", [0, 1], {0: 2})])], [("A", [4, 6])], [("B", [4, 6])])
    with pytest.raises(ShardingError, match="names tensor 'Q', which is neither an input nor an output"):
        nox.check(m)
    m = model([node("Relu", ["A"], ["B"], "r", [spec("A", [0, 1], {0: 2})], config="other")],
              [("A", [4, 6])], [("B", [4, 6])])
    with pytest.raises(ShardingError, match="configuration 'other' is not one of the model's configurations"):
        nox.check(m)


def test_annotate_output_is_valid():
    mesh = DeviceMesh("cfg", (2,), ("d",))
    m = model([node("MatMul", ["A", "W"], ["h"], "mm"), node("Add", ["h", "b"], ["y"], "add"),
               node("ReduceSum", ["y"], ["s"], "sum", keepdims=0)],
              [("A", [4, 6]), ("W", [6, 8]), ("b", [8])], [("s", [4])])
    del m.configuration[:]
    nox.check(nox.annotate(m, mesh, {"A": [None, "d"], "W": ["d", None]}))


def test_ops_nabla_cannot_run_take_onnx_shape_inference(monkeypatch):
    monkeypatch.delitem(OPS, "Det", raising=False)  # one nabla cannot run, even once nabla.onnx runs Det
    m = model([node("Det", ["A"], ["d"], "det"), node("Add", ["d", "B"], ["C"], "add", [spec("B", [0, 1], {0: 2})])],
              [("A", [4, 3, 3]), ("B", [4])], [("C", [4])])
    with pytest.raises(ShardingError, match=r"node 'add' \(Add\): tensor 'B' dim 0 is sharded .* tensor 'd' dim 0 "
                                            r"is replicated"):
        nox.check(m)  # d: shape [4] from ONNX's inference, replicated


def test_batched_matmul_batch_dims_broadcast():
    a_on_batch = [spec("A", [0, 1], {0: 2})]
    nox.check(model([node("MatMul", ["A", "B"], ["C"], "mm", a_on_batch)],
                    [("A", [2, 4, 6]), ("B", [6, 8])], [("C", [2, 4, 8])]))  # B has no batch dim
    nox.check(model([node("MatMul", ["A", "B"], ["C"], "mm", a_on_batch)],
                    [("A", [2, 4, 6]), ("B", [1, 6, 8])], [("C", [2, 4, 8])]))  # B's batch dim is broadcast
    with pytest.raises(ShardingError, match=r"tensor 'B' dim 0 is replicated but tensor 'A' dim 0 is sharded .* batch"):
        nox.check(model([node("MatMul", ["A", "B"], ["C"], "mm", a_on_batch)],
                        [("A", [2, 4, 6]), ("B", [2, 6, 8])], [("C", [2, 4, 8])]))
