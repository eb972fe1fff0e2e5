"""``export``: a nabla function traced into an ONNX model that carries the shardings nabla chose.

``fn`` runs once, eagerly (on abstract tensors no kernel runs), on twins of its tensor arguments (the same
blocks under serials of their own) under a comm log that keeps the values its steps read and make. The steps it
records (``nabla.step.Step``: the op, its params, each operand by serial and the program the executor chose),
those the outputs need that read an argument, in the order they ran, become the graph: one ONNX node (or a few)
per step, as the op's registry entry says (``OpDef.onnx``: an ONNX op type, or an export function next to the
op); a ``with_sharding`` or a host value placed on the mesh is an Identity; a move made for later uses is none
(the value keeps its name). What reads no argument is a constant, an initializer. An op made of other ops
(``log_softmax`` over a sharded dim) is told to the log as one step after theirs (``commlog.composed``), and
written as one node, as it was called. Under a ``DeviceConfigurationProto`` named after the mesh, the main node
of each step carries the layout each operand was brought to before the local kernel ran and the layout of the
result: what ``nb.jit`` and ``nb.explain`` read from the same steps.

Partial sums have no ONNX form: a value nabla holds as partial sums is annotated with its dims only (the
layout it has once summed). ``nox.run`` treats annotations as ``with_sharding``, so rerunning an exported
model sums such a value where the annotation sits, which may be earlier than nabla would; the values are
the same."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..commlog import CommLog, recording
from ..errors import ShardingError
from ..jit import inlined
from ..mesh import DeviceMesh
from ..ops import registry
from ..pytree import flatten, leaf_paths, unflatten
from ..spec import ShardingSpec
from ..step import BUCKET, MOVE, PLACE, RELAYOUT, Step, Use
from ..tensor import Tensor
from ..value import Value, serial
from .specs import spec_to_onnx

OPSET = 21
IR_VERSION = 10  # device configurations arrived in IR version 10


class _Mapping(Mapping):
    """nabla op name -> the ONNX op types its export uses (besides Cast, inserted where numpy's dtype rules and
    ONNX's same-type inputs differ): read from the op registry when asked, so ops registered later are in it."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        op = registry.REGISTRY.get(name)
        types = registry.onnx_types(op) if op is not None else ()
        if not types:
            raise KeyError(name)
        return types

    def __iter__(self) -> Iterator[str]:
        return (n for n, op in list(registry.REGISTRY.items()) if registry.onnx_types(op))

    def __len__(self) -> int:
        return sum(1 for _ in self)


MAPPING: Mapping[str, tuple[str, ...]] = _Mapping()


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


def _twin(t: Tensor) -> Tensor:
    """``t``'s blocks under a serial of their own (an argument passed twice is two graph inputs), without the sums
    an earlier use made of them (what a first run does)."""
    return Tensor(t._data, t._spec, t._shape, t._dtype, t._sid)


def _rebuild(tree: Any, leaves: list) -> Any:
    return unflatten(flatten(tree)[1], leaves)


class _Recorder(CommLog):
    """The trace's comm log, keeping the values its steps read and make (the constants' data, the operands'
    shapes), that also takes an op made of other ops as one step after theirs (see ``commlog.composed``)."""

    def __init__(self) -> None:
        super().__init__(keep_values=True)

    def composed(self, op: Any, params: tuple, args: tuple, out: Value) -> None:
        uses = tuple(Use(serial(a), a._shape, a._dtype, a._spec, a._spec) for a in args)
        self.take(Step(op, params, uses, serial(out), out._shape, out._dtype, out._spec, user=op.name),
                  [(u.value, a) for u, a in zip(uses, args)] + [(serial(out), out)])


def _needed(steps: list[Step], inputs: set[int], outputs: list[int]) -> list[Step]:
    """The steps the outputs need that read an input, in the order they ran (what reads none is a constant); a
    gradient bucket as one relayout per value, and no move made for later uses (the value keeps its serial).
    A value made again as one op (``composed``) is made by that step, so the steps it was made of are left."""
    flat: list[Step] = []
    for s in steps:
        if s.op == BUCKET:
            targets, outs = s.params
            flat += [Step(RELAYOUT, (t,), (u._replace(dst=t),), o, u.shape, u.dtype, t)
                     for u, t, o in zip(s.uses, targets, outs)]
        elif s.op != MOVE:
            flat.append(s)
    traced, made = set(inputs), {}
    for i, s in enumerate(flat):
        if s.out not in inputs and any(u.value in traced for u in s.uses):
            traced.add(s.out)
            made[s.out] = i
    live: set[int] = set()
    stack = [made[o] for o in outputs if o in made]
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack += [made[u.value] for u in flat[i].uses if u.value in made]
    return [flat[i] for i in sorted(live)]


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.names: dict[int, str] = {}  # a value's serial -> its tensor name
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
        """The name of ``value`` (a value by its serial: an initializer unless it has one; an array or a scalar)."""
        if isinstance(value, Value):
            if serial(value) in self.names:
                return self.names[serial(value)]
            if value._data is None:
                raise ShardingError(f"export: a constant operand of shape {value._shape} is abstract "
                                    f"(nb.abstract) and has no value to store; pass it as an argument of fn")
            self.see_mesh(value._spec, "a constant")
            t = value if isinstance(value, Tensor) else Tensor(value._data, value._spec, value._shape, value._dtype)
            arr = np.asarray(t.numpy()).reshape(value._shape)
            name = self.fresh(base)
            self.inits.append(numpy_helper.from_array(arr, name))
            self.names[serial(value)] = name
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
    twin_args, graph_inputs = [], []
    for a, pname in zip(args, arg_names):
        leaves, _ = flatten(a)
        paths = leaf_paths(a, pname, dotted=True) if isinstance(a, (dict, list, tuple)) else [pname]
        new_leaves = []
        for leaf, path in zip(leaves, paths):
            if isinstance(leaf, Tensor):
                t = _twin(leaf)
                iname = b.fresh(path)
                b.names[serial(t)] = iname
                b.see_mesh(leaf.sharding, f"input {iname!r}")
                graph_inputs.append(helper.make_tensor_value_info(iname, _onnx_type(leaf.dtype, iname),
                                                                  list(leaf.shape)))
                new_leaves.append(t)
            else:
                new_leaves.append(leaf)
        twin_args.append(_rebuild(a, new_leaves) if isinstance(a, (dict, list, tuple)) else new_leaves[0])
    with inlined(), recording(_Recorder()) as log:
        result = fn(*twin_args)
    out_leaves, _ = flatten(result)
    if isinstance(result, dict):
        out_paths = [p[len("output."):] for p in leaf_paths(result, "output", dotted=True)]
    elif isinstance(result, (list, tuple)):
        out_paths = [p.replace("output.", "output_", 1) for p in leaf_paths(result, "output", dotted=True)]
    else:
        out_paths = ["output"]
    for o in out_leaves:
        if not isinstance(o, Tensor):
            raise ShardingError(f"export: fn must return tensors (or a pytree of them), got {type(o).__name__}")
    outs = [serial(o) for o in out_leaves]
    steps = _needed(log.steps, set(b.names), outs)
    made = {s.out for s in steps}
    # a value returned once (and not an input) is produced under its output name directly
    renamed: dict[int, str] = {}
    for o, p in zip(outs, out_paths):
        if o in made and o not in renamed and o not in b.names:
            renamed[o] = b.fresh(p)
    annotations: dict[int, tuple[onnx.NodeProto, list[tuple[str, ShardingSpec]]]] = {}
    for s in steps:
        start = len(b.nodes)
        b.names[s.out], specs = _emit(b, s, log.values, renamed.get(s.out))
        if s.out_spec is not None:
            b.see_mesh(s.out_spec, f"the result of {s.name}")
        for tname, spec in specs:
            holder = _holder(b.nodes[start:], tname)
            if holder is not None and spec is not None:
                annotations.setdefault(id(holder), (holder, []))[1].append((tname, spec))
    outputs = []
    for o, s, p in zip(out_leaves, outs, out_paths):
        src = b.constant(o)  # (its name, when the trace made it or it is an input)
        if src in [x.name for x in outputs] or src in {vi.name for vi in graph_inputs} or \
                src in {i.name for i in b.inits} or renamed.get(s) != src:
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


_LOGICAL = {"BitwiseAnd": "And", "BitwiseOr": "Or", "BitwiseXor": "Xor", "BitwiseNot": "Not"}
# ONNX's Floor, Ceil and Round take floats, Relu and Neg signed numbers, Abs no bools; on the integers and bools
# numpy gives them to (by dtype kind) they are identities, or a subtraction from 0
_INTEGER_FORMS = {"Floor": dict.fromkeys("biu", "Identity"), "Ceil": dict.fromkeys("biu", "Identity"),
                  "Round": dict.fromkeys("biu", "Identity"), "Relu": dict.fromkeys("bu", "Identity"),
                  "Abs": {"b": "Identity"}, "Neg": {"u": "Sub"}}


def _wide_integer(op_type: str, dtype: np.dtype) -> np.dtype | None:
    """int32, for a MatMul of integers ONNX refuses (int8, int16, uint8, uint16; bools): sums of products wrap to the
    same low bits, and a bool matmul is nonzero where numpy's is True. None otherwise (a power does not wrap so:
    onnxruntime's integer Pow goes through double)."""
    if op_type != "MatMul" or dtype.kind not in "biu" or dtype.itemsize >= 4:
        return None
    return np.dtype(np.int32)


class _Export:
    """What an op's export function sees of one recorded step (see ``nabla.ops.registry``): the step, its operands
    (``args``: values, or Python scalars), params and result (``v``, its dtype), and the builder's steps named
    after the result."""

    def __init__(self, b: _Builder, step: Step, values: dict[int, Value], out_name: str | None) -> None:
        self.b, self.step, self.out_name = b, step, out_name
        self.args = tuple(values[u.value] if u.value else u.const for u in step.uses)
        self.v = values.get(step.out)
        self.name = step.name
        self.base = out_name or self.name
        self.params = step.params
        self.dtype = step.out_dtype

    def operand(self, i: int, dtype: np.dtype | None = None) -> str:
        """The name of operand ``i`` (a constant for a value no step here made), cast to ``dtype`` if given."""
        a = self.args[i]
        if isinstance(a, Value):
            nm = self.b.constant(a)
            return nm if dtype is None else self.b.cast(nm, a._dtype, dtype)
        return self.b.constant(a, dtype if dtype is not None else np.result_type(a))

    def out(self, op_type: str, inputs: list[str], **attrs) -> str:
        """The op's main node, whose output is the op's result."""
        nm = self.out_name or self.b.fresh(self.base)
        if self.out_name is not None:
            self.b.used.add(self.out_name)
        self.b.nodes.append(helper.make_node(op_type, inputs, [nm], name=self.b.fresh(f"{op_type}_{self.base}"),
                                             **attrs))
        return nm

    def emit(self, op_type: str, inputs: list[str], suffix: str, **attrs) -> str:
        """An intermediate node (before the main one)."""
        return self.b.node(op_type, inputs, f"{self.base}_{suffix}", **attrs)

    def ints(self, values, base: str = "shape") -> str:
        return self.b.ints(values, base)

    def onnx_type(self, dtype: np.dtype, what: str) -> int:
        return _onnx_type(dtype, what)

    def finish(self, name: str, main_inputs: list[tuple[str, int]]) -> tuple[str, list]:
        """The result's name and the annotations of the main node: the operands among ``main_inputs`` (name,
        operand index) as the kernel received them (the step's program's targets), and the result."""
        preps = getattr(self.step.prog, "preps", None)
        specs = [(nm, preps[i].target if preps is not None and i < len(preps) else None)
                 for nm, i in main_inputs if isinstance(self.args[i], Value)]
        specs.append((name, self.step.out_spec))
        return name, specs

    def one(self, op_type: str, cast: bool = True, **attrs) -> tuple[str, list]:
        """One node over every operand (in the result's dtype unless ``cast`` is False). ONNX's bitwise ops take
        integers only: on bools (JAX's ``mask & causal``, ``~mask``) they are its logical ops."""
        if self.dtype == np.bool_:
            op_type = _LOGICAL.get(op_type, op_type)
        if self.dtype.kind in "biu" and op_type in _INTEGER_FORMS:  # (ONNX's type constraints refuse these)
            op_type = _INTEGER_FORMS[op_type].get(self.dtype.kind, op_type)
            if op_type == "Sub":  # -x of an unsigned integer: 0 - x, which wraps as numpy's does
                x = self.operand(0, self.dtype)
                return self.finish(self.out("Sub", [self.b.constant(self.dtype.type(0), self.dtype), x]), [(x, 0)])
        wide = _wide_integer(op_type, self.dtype) if cast else None
        ins = [self.operand(i, wide or self.dtype if cast else None) for i in range(len(self.args))]
        main = [(x, i) for i, x in enumerate(ins)]
        if wide is not None:  # computed in int32 and cast back
            y = self.emit(op_type, ins, "wide", **attrs)
            return self.finish(self.out("Cast", [y], to=_onnx_type(self.dtype, self.name)), main)
        return self.finish(self.out(op_type, ins, **attrs), main)


def _emit(b: _Builder, step: Step, values: dict[int, Value], out_name: str | None
          ) -> tuple[str, list[tuple[str, ShardingSpec | None]]]:
    """Emit the nodes computing ``step``'s result as its op's registry entry says; returns its tensor name and the
    (tensor, spec) annotations for the op's main node: its data inputs as the kernel received them, and its
    output."""
    ex = _Export(b, step, values, out_name)
    if step.op in (RELAYOUT, PLACE):
        return ex.finish(ex.out("Identity", [ex.operand(0)]), [])
    how = getattr(step.op, "onnx", None)
    if how is None:
        raise ShardingError(f"export: op {ex.name!r} has no ONNX mapping (ops with one: {sorted(MAPPING)})")
    return ex.one(how) if isinstance(how, str) else how(ex)
