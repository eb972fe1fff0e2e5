"""``export``: a nabla function traced into an ONNX model that carries the shardings nabla chose.

Each tensor argument becomes a traced leaf (a twin sharing its blocks, as autodiff makes them); ``fn`` runs
eagerly (on abstract tensors no kernel runs), and every result that depends on a leaf records a ``Node``:
the op, its params, its operands and the executor's program. The trace, operands first, becomes the graph:
one ONNX node (or a few) per nabla op, constants as initializers, and under a ``DeviceConfigurationProto``
named after the mesh, on the main node of each op, the layout each operand was brought to before the
local kernel ran and the layout of the result.

Partial sums have no ONNX form: a value nabla holds as partial sums is annotated with its dims only (the
layout it has once summed). ``nox.run`` treats annotations as ``with_sharding``, so rerunning an exported
model sums such a value where the annotation sits, which may be earlier than nabla would; the values are
the same."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff import flatten
from ..errors import ShardingError
from ..executor import Value
from ..mesh import DeviceMesh
from ..spec import ShardingSpec
from ..tensor import Tensor
from ..trace import LEAF, LEAF_NODE, PLACE, RELAYOUT, topological
from .specs import spec_to_onnx

OPSET = 21
IR_VERSION = 10  # device configurations arrived in IR version 10
INT64_MIN = -(2 ** 63)

_BINARY = {"add": "Add", "subtract": "Sub", "multiply": "Mul", "divide": "Div", "power": "Pow",
           "maximum": "Max", "minimum": "Min"}
_BOOL_BINARY = {"add": "Or", "maximum": "Or", "multiply": "And", "minimum": "And"}  # numpy's bool arithmetic
_COMPARE = {"less": "Less", "less_equal": "LessOrEqual", "greater": "Greater", "greater_equal": "GreaterOrEqual",
            "equal": "Equal", "not_equal": "Equal"}  # not_equal: Not(Equal)
_UNARY = {"negative": "Neg", "exp": "Exp", "log": "Log", "tanh": "Tanh", "sin": "Sin", "cos": "Cos",
          "sqrt": "Sqrt", "abs": "Abs", "relu": "Relu", "sigmoid": "Sigmoid", "reciprocal": "Reciprocal"}
_REDUCE = {"sum": "ReduceSum", "max": "ReduceMax", "min": "ReduceMin"}
_OTHER = ("where", "astype", "matmul", "einsum", "argmax", "softmax", "transpose", "reshape", "broadcast_to",
          "expand_dims", "squeeze", "concatenate", "getitem", "conv", "max_pool", "avg_pool")

#: nabla op name -> the ONNX op types its export uses (besides Cast, inserted where numpy's dtype rules
#: and ONNX's same-type inputs differ)
MAPPING: dict[str, tuple[str, ...]] = {
    **{k: (v,) for k, v in _BINARY.items()},
    **{k: (v,) for k, v in _COMPARE.items()}, "not_equal": ("Equal", "Not"),
    **{k: (v,) for k, v in _UNARY.items()},
    **{k: (v,) for k, v in _REDUCE.items()},
    "where": ("Where",), "astype": ("Cast",), "matmul": ("MatMul",), "einsum": ("Einsum",),
    "argmax": ("ArgMax", "Reshape"), "softmax": ("Softmax",), "transpose": ("Transpose",),
    "reshape": ("Reshape",), "broadcast_to": ("Expand",), "expand_dims": ("Unsqueeze",),
    "squeeze": ("Squeeze",), "concatenate": ("Concat",), "getitem": ("Slice", "Squeeze", "Unsqueeze"),
    "conv": ("Conv",), "max_pool": ("MaxPool",), "avg_pool": ("AveragePool",),
    "conv_act": ("Conv", "Relu"), "add_relu": ("Add", "Relu"),  # nox.run's fused epilogues (fuse.py)
}


def _onnx_type(dtype: np.dtype, what: str) -> int:
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except Exception:  # noqa: BLE001
        raise ShardingError(f"export: {what} has dtype {dtype}, which ONNX has no element type for") from None


def _param_names(fn: Callable, n: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind != params[i].VAR_POSITIONAL:
            names.append(params[i].name)
        elif params and params[-1].kind == params[-1].VAR_POSITIONAL:
            names.append(f"{params[-1].name}_{i - len(params) + 1}")
        else:
            names.append(f"arg{i}")
    return names


def _paths(tree: Any, prefix: str) -> list[str]:
    """A name for each leaf of ``tree`` (``flatten``'s order): the prefix, then keys and indices."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _paths(v, f"{prefix}.{k}")]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in _paths(v, f"{prefix}.{i}")]
    return [] if tree is None else [prefix]


def _traced(t: Tensor) -> Tensor:
    """A traced twin of ``t``: the same blocks, recording every op that uses it (autodiff's ``_leaf``)."""
    leaf = Tensor(t._data, t._spec, t._shape, t._dtype, t._sid)
    leaf._node = LEAF_NODE
    return leaf


def _rebuild(tree: Any, leaves: list) -> Any:
    from ..autodiff import unflatten
    return unflatten(flatten(tree)[1], leaves)


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: dict[int, str] = {}  # id(value) -> tensor name
        self.keep: list[Any] = []  # values whose ids are in ``names`` stay alive
        self.used: set[str] = set()
        self.counts: dict[str, int] = {}
        self.mesh: DeviceMesh | None = None
        self.scalars: dict[tuple, str] = {}

    # -- names ----------------------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        base = base or "t"
        k = self.counts.get(base, 0)
        name = base if k == 0 and base not in self.used else f"{base}_{k}"
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.counts[base] = k + 1
        self.used.add(name)
        return name

    def see_mesh(self, spec: ShardingSpec | None, what: str) -> None:
        if spec is None:
            return
        if self.mesh is None:
            self.mesh = spec.mesh
        elif spec.mesh != self.mesh:
            raise ShardingError(f"export: {what} is on mesh {spec.mesh!r} but the trace already uses "
                                f"{self.mesh!r}; an ONNX model here carries one device configuration")

    # -- constants -----------------------------------------------------------------------------------------
    def constant(self, value: Any, dtype: np.dtype | None = None, base: str = "const") -> str:
        """The name of an initializer holding ``value`` (a Tensor without a trace, an array or a scalar)."""
        if isinstance(value, Value):
            if id(value) in self.names:
                return self.names[id(value)]
            if value._data is None:
                raise ShardingError(f"export: a constant operand of shape {value._shape} is abstract "
                                    f"(nb.abstract) and has no value to store; pass it as an argument of fn")
            self.see_mesh(value._spec, "a constant")
            t = value if isinstance(value, Tensor) else Tensor(value._data, value._spec, value._shape, value._dtype)
            arr = np.asarray(t.numpy()).reshape(value._shape)
            name = self.fresh(base)
            self.inits.append(numpy_helper.from_array(arr, name))
            self.names[id(value)] = name
            self.keep.append(value)
            return name
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if arr.ndim <= 1 and key in self.scalars:
            return self.scalars[key]
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(arr, name))
        if arr.ndim <= 1:
            self.scalars[key] = name
        return name

    def ints(self, values, base: str = "shape") -> str:
        return self.constant(np.array(list(values), dtype=np.int64), base=base)

    # -- nodes ----------------------------------------------------------------------------------------------
    def node(self, op_type: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.fresh(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(f"{op_type}_{base}"), **attrs))
        return out

    def cast(self, name: str, src: np.dtype, dst: np.dtype) -> str:
        if np.dtype(src) == np.dtype(dst):
            return name
        return self.node("Cast", [name], f"{name}_as_{np.dtype(dst).name}", to=_onnx_type(dst, name))


def _dtype_of(a: Any) -> Any:
    return a._dtype if isinstance(a, Value) else a


def export(fn: Callable, *args: Any, name: str | None = None) -> onnx.ModelProto:
    """Trace ``fn(*args)`` on nabla tensors (real or ``nb.abstract``) into an ONNX ``ModelProto``.

    Graph inputs are the tensors among ``args`` in order (pytrees of them flattened, dicts in insertion
    order), named after ``fn``'s parameters; other arguments are passed through as they are, and every
    tensor, array or scalar the trace uses that is not an input becomes an initializer. Graph outputs are
    the tensors ``fn`` returns (a tensor, or a pytree of them). When the trace runs on a mesh, the model has a
    ``DeviceConfigurationProto`` named after it and each op's main node carries, under it, the shardings
    nabla chose: each operand's layout as the local kernel received it and the result's (dims only for
    partial sums, which ONNX cannot express; see the module doc). An op with no ONNX form raises
    ``ShardingError`` naming it.
    """
    if not callable(fn):
        raise ShardingError(f"export: fn must be callable, got {type(fn).__name__}")
    b = _Builder()
    arg_names = _param_names(fn, len(args))
    traced_args, graph_inputs = [], []
    for a, pname in zip(args, arg_names):
        leaves, _ = flatten(a)
        paths = _paths(a, pname) if isinstance(a, (dict, list, tuple)) else [pname]
        new_leaves = []
        for leaf, path in zip(leaves, paths):
            if isinstance(leaf, Tensor):
                t = _traced(leaf)
                iname = b.fresh(path)
                b.names[id(t)] = iname
                b.keep.append(t)
                b.see_mesh(leaf.sharding, f"input {iname!r}")
                graph_inputs.append(helper.make_tensor_value_info(iname, _onnx_type(leaf.dtype, iname),
                                                                  list(leaf.shape)))
                new_leaves.append(t)
            else:
                new_leaves.append(leaf)
        traced_args.append(_rebuild(a, new_leaves) if isinstance(a, (dict, list, tuple)) else new_leaves[0])
    from ..jit import inlined  # a jitted function exports as its ops
    with inlined():
        result = fn(*traced_args)
    out_leaves, _ = flatten(result)
    if isinstance(result, dict):
        out_paths = [p[len("output."):] for p in _paths(result, "output")]
    elif isinstance(result, (list, tuple)):
        out_paths = [p.replace("output.", "output_", 1) for p in _paths(result, "output")]
    else:
        out_paths = ["output"]
    for o in out_leaves:
        if not isinstance(o, Tensor):
            raise ShardingError(f"export: fn must return tensors (or a pytree of them), got {type(o).__name__}")
    order = topological(out_leaves)
    # a value returned once (and not an input) is produced under its output name directly
    renamed: dict[int, str] = {}
    for o, p in zip(out_leaves, out_paths):
        if o._node is not None and o._node.op is not LEAF and id(o) not in renamed and id(o) not in b.names:
            renamed[id(o)] = b.fresh(p)
    annotations: dict[int, tuple[onnx.NodeProto, list[tuple[str, ShardingSpec]]]] = {}
    for v in order:
        node = v._node
        if node.op == LEAF:
            if id(v) not in b.names:  # a traced value from an enclosing trace: a constant here
                b.constant(v)
            continue
        start = len(b.nodes)
        out_name, specs = _emit(b, v, renamed.get(id(v)))
        b.names[id(v)] = out_name
        b.keep.append(v)
        if v.sharding is not None:
            b.see_mesh(v.sharding, f"the result of {getattr(node.op, 'name', node.op)}")
        for tname, spec in specs:
            holder = _holder(b.nodes[start:], tname)
            if holder is not None and spec is not None:
                annotations.setdefault(id(holder), (holder, []))[1].append((tname, spec))
    outputs = []
    for o, p in zip(out_leaves, out_paths):
        src = b.names.get(id(o))
        if src is None:  # not traced: a constant result
            src = b.constant(o)
        if src in [x.name for x in outputs] or src in {vi.name for vi in graph_inputs} or \
                src in {i.name for i in b.inits} or renamed.get(id(o)) != src:
            src = b.node("Identity", [src], p)
            if o.sharding is not None:
                b.see_mesh(o.sharding, f"output {p!r}")
                annotations[id(b.nodes[-1])] = (b.nodes[-1], [(src, o.sharding)])
        outputs.append(helper.make_tensor_value_info(src, _onnx_type(o.dtype, p), list(o.shape)))
    if b.mesh is not None:
        _annotate(b.mesh, list(annotations.values()))  # on b.nodes, before the graph copies them
    gname = name or getattr(fn, "__name__", "") or "nabla"
    graph = helper.make_graph(b.nodes, "lambda" if gname == "<lambda>" else gname, graph_inputs,
                              outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="nabla")
    model.ir_version = IR_VERSION
    if b.mesh is not None:
        model.configuration.append(onnx.DeviceConfigurationProto(name=b.mesh.name, num_devices=b.mesh.size))
    onnx.checker.check_model(model)
    return model


def _holder(nodes: list[onnx.NodeProto], tname: str) -> onnx.NodeProto | None:
    """The node an annotation of ``tname`` belongs on: the one producing it, else the first consuming it."""
    for n in reversed(nodes):
        if tname in n.output:
            return n
    for n in nodes:
        if tname in n.input:
            return n
    return None


def _annotate(mesh: DeviceMesh, annotations: list[tuple[onnx.NodeProto, list[tuple[str, ShardingSpec]]]]) -> None:
    if sorted(mesh.devices) != list(range(mesh.size)):
        raise ShardingError(f"export: ONNX device ids index a configuration's {mesh.size} devices, but mesh "
                            f"{mesh!r} has device ids {list(mesh.devices)}; use ids 0..{mesh.size - 1}")
    for proto, specs in annotations:
        seen, protos = set(), []
        for tname, spec in specs:
            if spec is None or tname in seen or spec.mesh != mesh:
                continue
            seen.add(tname)
            dims_only = ShardingSpec(mesh, [d.axes for d in spec.dim_specs])  # no partial axes, closed dims
            protos.append(spec_to_onnx(dims_only, tname))
        if protos:
            proto.device_configurations.append(onnx.NodeDeviceConfigurationProto(configuration_id=mesh.name,
                                                                                 sharding_spec=protos))


# ---- one nabla op -> ONNX nodes ------------------------------------------------------------------------------


def _emit(b: _Builder, v: Tensor, out_name: str | None) -> tuple[str, list[tuple[str, ShardingSpec | None]]]:
    """Emit the nodes computing ``v``; returns its tensor name and the (tensor, spec) annotations for the
    last node emitted (the op's main node): its data inputs as the kernel received them, and its output."""
    node = v._node
    op = node.op
    base = out_name or (op if isinstance(op, str) else op.name)
    prog = node.prog

    def operand(i: int, dtype: np.dtype | None = None) -> str:
        a = node.args[i]
        if isinstance(a, Value):
            nm = b.names[id(a)] if id(a) in b.names else b.constant(a)
            return nm if dtype is None else b.cast(nm, a._dtype, dtype)
        return b.constant(a, dtype if dtype is not None else np.result_type(a))

    def target(i: int) -> ShardingSpec | None:
        if prog is None or not hasattr(prog, "preps") or i >= len(prog.preps):
            return None
        return prog.preps[i].target

    def finish(name: str, main_inputs: list[tuple[str, int]]) -> tuple[str, list]:
        specs = [(nm, target(i)) for nm, i in main_inputs if isinstance(node.args[i], Value)]
        specs.append((name, v.sharding))
        return name, specs

    def out(op_type: str, inputs: list[str], **attrs) -> str:
        nm = out_name or b.fresh(base)
        if out_name is not None:
            b.used.add(out_name)
        b.nodes.append(helper.make_node(op_type, inputs, [nm], name=b.fresh(f"{op_type}_{base}"), **attrs))
        return nm

    if op in (RELAYOUT, PLACE):
        return finish(out("Identity", [operand(0)]), [])
    name = op.name
    dt = v._dtype
    n_args = len(node.args)
    if name in _BINARY:
        if dt == np.bool_ and name in _BOOL_BINARY:
            ins = [operand(i, dt) for i in range(2)]
            return finish(out(_BOOL_BINARY[name], ins), [(ins[0], 0), (ins[1], 1)])
        if dt == np.bool_:
            raise ShardingError(f"export: op {name} on bool operands has no ONNX form (numpy computes it as "
                                f"int8 and casts back); cast the operands first")
        ins = [operand(i, dt) for i in range(2)]
        return finish(out(_BINARY[name], ins), [(ins[0], 0), (ins[1], 1)])
    if name in _COMPARE:
        common = np.result_type(*(_dtype_of(a) for a in node.args))
        ins = [operand(i, common) for i in range(2)]
        if name == "not_equal":
            eq = b.node("Equal", ins, f"{base}_eq")
            return finish(out("Not", [eq]), [(ins[0], 0), (ins[1], 1)])
        return finish(out(_COMPARE[name], ins), [(ins[0], 0), (ins[1], 1)])
    if name in _UNARY:
        x = operand(0, dt)
        return finish(out(_UNARY[name], [x]), [(x, 0)])
    if name == "where":
        c = operand(0, np.dtype(np.bool_))
        a, bb = operand(1, dt), operand(2, dt)
        return finish(out("Where", [c, a, bb]), [(c, 0), (a, 1), (bb, 2)])
    if name == "astype":
        x = operand(0)
        return finish(out("Cast", [x], to=_onnx_type(dt, "astype's result")), [(x, 0)])
    if name == "matmul":
        ins = [operand(i, dt) for i in range(2)]
        return finish(out("MatMul", ins), [(ins[0], 0), (ins[1], 1)])
    if name == "einsum":
        ins = [operand(i, dt) for i in range(n_args)]
        return finish(out("Einsum", ins, equation=_explicit(node.params[0])), [(x, i) for i, x in enumerate(ins)])
    if name in _REDUCE:
        axes, keepdims = node.params
        x = operand(0, dt)
        ins = [x, b.ints(axes, "axes")]
        return finish(out(_REDUCE[name], ins, keepdims=int(keepdims), noop_with_empty_axes=int(not axes)), [(x, 0)])
    if name == "argmax":
        axis, = node.params
        x = operand(0)
        if axis is None:
            x = b.node("Reshape", [x, b.ints([-1])], f"{base}_flat")
            axis = 0
        x0 = operand(0)
        if dt == np.int64:
            return finish(out("ArgMax", [x], axis=int(axis), keepdims=0), [(x0, 0)])
        i64 = b.node("ArgMax", [x], f"{base}_i64", axis=int(axis), keepdims=0)
        return finish(out("Cast", [i64], to=_onnx_type(dt, "argmax's result")), [(x0, 0)])
    if name == "softmax":
        x = operand(0, dt)
        return finish(out("Softmax", [x], axis=int(node.params[0])), [(x, 0)])
    if name == "transpose":
        x = operand(0)
        return finish(out("Transpose", [x], perm=[int(p) for p in node.params[0]]), [(x, 0)])
    if name == "reshape":
        x = operand(0)
        target_shape = [int(s) for s in node.params[0]]
        attrs = {"allowzero": 1} if 0 in target_shape else {}
        return finish(out("Reshape", [x, b.ints(target_shape)], **attrs), [(x, 0)])
    if name == "broadcast_to":
        x = operand(0)
        return finish(out("Expand", [x, b.ints(node.params[0])]), [(x, 0)])
    if name in ("expand_dims", "squeeze"):
        x = operand(0)
        axes = tuple(node.params[0])
        if not axes:
            return finish(out("Identity", [x]), [(x, 0)])
        return finish(out("Unsqueeze" if name == "expand_dims" else "Squeeze", [x, b.ints(axes, "axes")]), [(x, 0)])
    if name == "concatenate":
        ins = [operand(i, dt) for i in range(n_args)]
        return finish(out("Concat", ins, axis=int(node.params[0])), [(x, i) for i, x in enumerate(ins)])
    if name == "getitem":
        return _getitem(b, node, operand(0), base, out, finish)
    if name == "conv":
        stride, pads, dilation, groups = node.params
        x, w = operand(0, dt), operand(1, dt)
        kernel = [int(k) for k in node.args[1]._shape[2:]]
        return finish(out("Conv", [x, w], strides=list(stride), pads=_pads(pads), dilations=list(dilation),
                          group=int(groups), kernel_shape=kernel), [(x, 0), (w, 1)])
    if name == "conv_act":  # Conv with its bias, then Relu when fused
        stride, pads, dilation, groups, relu = node.params
        ins = [operand(i, dt) for i in range(n_args)]
        kernel = [int(k) for k in node.args[1]._shape[2:]]
        attrs = dict(strides=list(stride), pads=_pads(pads), dilations=list(dilation), group=int(groups),
                     kernel_shape=kernel)
        main = [(x, i) for i, x in enumerate(ins)]
        if not relu:
            return finish(out("Conv", ins, **attrs), main)
        return finish(out("Relu", [b.node("Conv", ins, f"{base}_conv", **attrs)]), main)
    if name == "add_relu":
        ins = [operand(i, dt) for i in range(2)]
        return finish(out("Relu", [b.node("Add", ins, f"{base}_sum")]), [(ins[0], 0), (ins[1], 1)])
    if name == "max_pool":
        kernel, stride, pads, dilation = node.params
        x = operand(0)
        return finish(out("MaxPool", [x], kernel_shape=list(kernel), strides=list(stride), pads=_pads(pads),
                          dilations=list(dilation)), [(x, 0)])
    if name == "avg_pool":
        kernel, stride, pads, dilation, include = node.params
        x = operand(0, dt)
        return finish(out("AveragePool", [x], kernel_shape=list(kernel), strides=list(stride), pads=_pads(pads),
                          dilations=list(dilation), count_include_pad=int(include)), [(x, 0)])
    raise ShardingError(f"export: op {name!r} has no ONNX mapping (ops with one: {sorted(MAPPING)})")


def _pads(pads) -> list[int]:
    """nabla's (before, after) per spatial dim -> ONNX's begins then ends."""
    return [int(lo) for lo, _ in pads] + [int(hi) for _, hi in pads]


def _explicit(subscripts: str) -> str:
    """numpy's implicit einsum output made explicit (ellipsis dims, then letters used once, sorted)."""
    s = subscripts.replace(" ", "")
    lhs, arrow, rhs = s.partition("->")
    if arrow:
        return s
    letters = lhs.replace(".", "").replace(",", "")
    rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return f"{lhs}->{rhs}"


def _getitem(b: _Builder, node, x: str, base: str, out, finish):
    """Basic indexing: one Slice over the sliced, reversed and indexed dims, then Squeeze the indexed dims and
    Unsqueeze the new ones."""
    key = node.params[0]
    starts, ends, axes, steps, squeeze, new = [], [], [], [], [], []
    d = 0  # input dim
    o = 0  # output dim (entries that are not ints)
    for e in key:
        kind = e[0]
        if kind == "new":
            new.append(o)
            o += 1
            continue
        if kind == "reverse":
            starts.append(-1), ends.append(INT64_MIN), axes.append(d), steps.append(-1)
        elif kind == "slice":
            start, stop, step = e[1:]
            starts.append(start), axes.append(d), steps.append(step)
            ends.append(INT64_MIN if step < 0 and stop < 0 else stop)
        elif kind == "int":
            starts.append(e[1]), ends.append(e[1] + 1), axes.append(d), steps.append(1)
            squeeze.append(d)
        d += 1
        if kind != "int":
            o += 1
    stages = []
    if axes:
        stages.append(("Slice", [b.ints(starts, "starts"), b.ints(ends, "ends"), b.ints(axes, "axes"),
                                 b.ints(steps, "steps")]))
    if squeeze:
        stages.append(("Squeeze", [b.ints(squeeze, "axes")]))
    if new:
        stages.append(("Unsqueeze", [b.ints(new, "axes")]))
    if not stages:
        return finish(out("Identity", [x]), [(x, 0)])
    cur = x
    for k, (op_type, extra) in enumerate(stages):
        if k == len(stages) - 1:
            return finish(out(op_type, [cur] + extra), [(x, 0)])
        cur = b.node(op_type, [cur] + extra, f"{base}_{op_type.lower()}")
