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

import functools
import inspect
from math import prod
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import ml_dtypes
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

    Every node takes its operands' element types under ONNX's type constraints (opset 21; the model passes
    ``onnx.checker`` with full type inference): where an op's own type is refused (ReduceMax of int16, TopK of bools
    or bfloat16, Sin of bfloat16) it is computed in a wider type that holds each value (int32, float32) and cast
    back; integer powers, sums and products are written to wrap as numpy's (onnxruntime computes its integer Pow,
    ReduceSum and ReduceProd through double). An op ONNX has no form for at all (complex arithmetic and comparisons;
    a conv of integers) raises ``ShardingError`` naming it and its operands' dtypes. Two runtime differences remain:
    onnxruntime's Where returns +0.0 for a selected -0.0 (ONNX's reference keeps the sign), and a max_pool window
    holding NaN pools to the max of the rest in onnxruntime and in ONNX's reference (nabla's max_pool gives NaN).
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
    made_by: dict[str, Step] = {}  # node name -> the step it was written for
    for s in steps:
        start = len(b.nodes)
        b.names[s.out], specs = _emit(b, s, log.values, renamed.get(s.out))
        made_by.update((n.name, s) for n in b.nodes[start:])
        if s.out_spec is not None:
            b.see_mesh(s.out_spec, f"the result of {s.name}")
        for tname, spec in specs:
            for holder in _holders(b.nodes[start:], tname) if spec is not None else ():
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
    _valid(model, made_by)
    return model


def _valid(model: onnx.ModelProto, made_by: dict[str, Step]) -> None:
    """``onnx.checker`` with ONNX's strict shape and type inference: a node ONNX refuses (its type constraints take
    no such element type: complex arithmetic, a comparison of complex numbers) raises ShardingError naming the op
    it was written for and its operands' dtypes, rather than giving a model onnxruntime refuses."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        step = next((st for nm, st in made_by.items() if f"node name: {nm})" in msg), None)
        if step is None:
            raise
        dtypes = ", ".join(str(u.dtype) for u in step.uses if u.value) or "constants"
        raise ShardingError(f"export: op {step.name!r} (operands {dtypes}) has no ONNX form: the node written for "
                            f"it is one ONNX refuses: {msg}") from None


def _holders(nodes: list[onnx.NodeProto], tname: str) -> list[onnx.NodeProto]:
    """The nodes (of one step's) an annotation of ``tname`` belongs on: the one producing it, else every one
    consuming it (each reads the operand as the kernel received it: a NaN test beside a ReduceMax reads it laid out
    as the ReduceMax does, not as an unannotated input, which the formalism takes as unsharded)."""
    for n in reversed(nodes):
        if tname in n.output:
            return [n]
    return [n for n in nodes if tname in n.input]


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


# The wider dtypes a value is computed in where ONNX's type constraints refuse its own, narrowest first: each holds
# every value of the narrower one exactly, so order (Max, TopK, ArgMax, comparisons) is kept, and sums and products of
# integers wrap to the same low bits once cast back (a bool's count is nonzero where numpy's logic is True, so bools
# take int32 first: a uint8 count of 256 would be 0; uint8 last, for MaxPool, which counts nothing). A float16 or
# bfloat16 op computed in float32 and rounded once is what numpy's and ml_dtypes' loops for them do.
_WIDER = {np.dtype(k): tuple(np.dtype(t) for t in v) for k, v in {
    np.bool_: (np.int32, np.int64, np.uint8), np.int8: (np.int16, np.int32, np.int64),
    np.uint8: (np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64), np.int16: (np.int32, np.int64),
    np.uint16: (np.int32, np.uint32, np.int64, np.uint64), np.int32: (np.int64,), np.uint32: (np.int64, np.uint64),
    np.float16: (np.float32, np.float64), ml_dtypes.bfloat16: (np.float32, np.float64), np.float32: (np.float64,),
}.items()}


@functools.lru_cache(maxsize=512)
def allowed(op_type: str, dtype: np.dtype, operand: int = 0) -> tuple[str, ...] | None:
    """The element types ONNX's ``op_type`` (at the exported opset) takes for input ``operand``, when ``dtype`` is
    not among them; None when it is (or the op has no such constraint)."""
    schema = onnx.defs.get_schema(op_type, OPSET)
    tparam = schema.inputs[min(operand, len(schema.inputs) - 1)].type_str
    types = {c.type_param_str: tuple(c.allowed_type_strs) for c in schema.type_constraints}.get(tparam)
    name = f"tensor({onnx.TensorProto.DataType.Name(_onnx_type(dtype, 'a value')).lower()})"
    return None if types is None or name in types else types


@functools.lru_cache(maxsize=512)
def carrier(op_types: tuple[str, ...], dtype: np.dtype, what: str = "") -> np.dtype:
    """The dtype nodes of ``op_types`` compute ``dtype``'s values in: ``dtype`` when ONNX's type constraints allow
    it, else the narrowest wider one they all allow (``_WIDER``). Raises ShardingError when there is none (complex
    arithmetic: ONNX's math ops take no complex tensor)."""
    dtype = np.dtype(dtype)
    for work in (dtype,) + _WIDER.get(dtype, ()):
        if all(allowed(t, work) is None for t in op_types):
            return work
    refused = next(t for t in op_types if allowed(t, dtype) is not None)
    raise ShardingError(f"export: {what or 'an op'} on {dtype} values has no ONNX form: ONNX's {refused} (opset "
                        f"{OPSET}) takes {', '.join(t[7:-1] for t in sorted(allowed(refused, dtype)))}, and none of "
                        f"them holds every {dtype} value")


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
        self.likes: list[tuple[str, int]] = []  # intermediates laid out as an operand (its index) or the result (-1)

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

    def emit(self, op_type: str, inputs: list[str], suffix: str, like: int | None = None, **attrs) -> str:
        """An intermediate node (before the main one); ``like``: its output is laid out as operand ``like`` is when
        the kernel receives it (-1: as the result), and is annotated so (a NaN flag of each element, the pooled
        flags)."""
        nm = self.b.node(op_type, inputs, f"{self.base}_{suffix}", **attrs)
        if like is not None:
            self.likes.append((nm, like))
        return nm

    def ints(self, values, base: str = "shape") -> str:
        return self.b.ints(values, base)

    def nan_flags(self, x: str, like: int | None = 0) -> str:
        """uint8: 1 where ``x`` (floats) is NaN (laid out as operand ``like``)."""
        return self.emit("Cast", [self.emit("IsNaN", [x], "isnan", like=like)], "nan_u8", like=like,
                         to=_onnx_type(np.dtype(np.uint8), "a flag"))

    def any_of(self, flags: str, axes, keepdims: bool) -> str:
        """bool: whether any of ``flags`` (uint8) is set along ``axes`` (laid out as the result)."""
        hit = self.emit("ReduceMax", [flags, self.ints(axes, "axes")], "any", like=-1, keepdims=int(keepdims))
        return self.emit("Cast", [hit], "any_bool", like=-1, to=_onnx_type(np.dtype(np.bool_), "a flag"))

    def reduced_last(self, x: str, axes) -> tuple[str, int]:
        """Operand 0 (named ``x``) with its ``axes`` moved last and flattened into one dim after the kept dims, and
        that dim's size."""
        shape = self.args[0]._shape
        keep = [d for d in range(len(shape)) if d not in axes]
        n = prod(shape[d] for d in axes)
        perm = keep + list(axes)
        moved = self.emit("Transpose", [x], "moved", perm=perm) if perm != list(range(len(shape))) else x
        return self.emit("Reshape", [moved, self.ints([shape[d] for d in keep] + [n])], "flat"), n

    def onnx_type(self, dtype: np.dtype, what: str) -> int:
        return _onnx_type(dtype, what)

    def carrier(self, *op_types: str, dtype: np.dtype | None = None) -> np.dtype:
        """The dtype nodes of ``op_types`` compute ``dtype``'s values in (default: the result's); see ``carrier``."""
        return carrier(op_types, np.dtype(self.dtype if dtype is None else dtype), f"op {self.name!r}")

    def out_as(self, work: np.dtype, op_type: str, inputs: list[str], **attrs) -> str:
        """The op's main node, computed in ``work`` (a carrier): cast to the result's dtype after it when they
        differ."""
        if np.dtype(work) == self.dtype:
            return self.out(op_type, inputs, **attrs)
        return self.out("Cast", [self.emit(op_type, inputs, "wide", like=-1, **attrs)],
                        to=_onnx_type(self.dtype, self.name))

    def finish(self, name: str, main_inputs: list[tuple[str, int]]) -> tuple[str, list]:
        """The result's name and the annotations of the step's nodes: the operands among ``main_inputs`` (name,
        operand index) as the kernel received them (the step's program's targets), the intermediates emitted
        ``like`` an operand or the result, and the result."""
        preps = getattr(self.step.prog, "preps", None)

        def spec(i: int):
            if i < 0:
                return self.step.out_spec
            return preps[i].target if preps is not None and i < len(preps) else None

        specs = [(nm, spec(i)) for nm, i in main_inputs + self.likes if i < 0 or isinstance(self.args[i], Value)]
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
        work = self.carrier(op_type) if cast else self.dtype
        ins = [self.operand(i, work if cast else None) for i in range(len(self.args))]
        return self.finish(self.out_as(work, op_type, ins, **attrs), [(x, i) for i, x in enumerate(ins)])


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
