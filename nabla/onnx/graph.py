"""Running an ONNX graph eagerly on nabla: validation before anything runs (op types, attributes,
annotations), the mesh and configuration, placement of inputs and initializers, and a node-by-node
walk where annotations act as ``with_sharding``. ``check`` and ``annotate`` walk the same way."""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np
import onnx
import onnx.inliner
from onnx import helper, numpy_helper

import nabla as nb

from .. import collectives as C
from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..executor import place
from ..ops import apply
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from .fuse import ADD_RELU, Fold, fold, foldable
from .ops import Node, Op, conv_act, entry, holdable
from .specs import config_mesh, node_specs, spec_from_onnx

_DOMAINS = ("", "ai.onnx")


def load(model: Any) -> onnx.ModelProto:
    """A ModelProto from a proto, a path or bytes, with model-local functions inlined."""
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    elif isinstance(model, (bytes, bytearray)):
        model = onnx.load_from_string(bytes(model))
    elif not isinstance(model, onnx.ModelProto):
        raise ShardingError(f"expected an onnx.ModelProto, a path or bytes, got {type(model).__name__}")
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    return model


def opset_of(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in _DOMAINS:
            return imp.version
    return onnx.defs.onnx_opset_version()


def label(node: onnx.NodeProto, i: int) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"node #{i} ({node.op_type})"


class CheckedNode:
    """One node, validated: its handler, its context, and its annotations by tensor name."""

    __slots__ = ("proto", "index", "node", "op", "specs")

    def __init__(self, proto: onnx.NodeProto, index: int, node: Node, op: Op,
                 specs: dict[str, onnx.ShardingSpecProto]) -> None:
        self.proto, self.index, self.node, self.op, self.specs = proto, index, node, op, specs


class Program:
    """A model checked end to end before it runs: every op known, every annotation well formed."""

    def __init__(self, model: onnx.ModelProto, config_id: str | None, strict_ops: bool = True) -> None:
        self.model = model
        self.graph = model.graph
        self.opset = opset_of(model)
        self.config_id = config_id
        self.steps: list[CheckedNode] = []
        for i, p in enumerate(self.graph.node):
            where = label(p, i)
            node = Node(p, self.opset, where)
            op = entry(p.op_type, len(p.input), bool(p.attribute)) if p.domain in _DOMAINS else None
            if op is None and strict_ops:
                dom = f" in domain {p.domain!r}" if p.domain not in _DOMAINS else ""
                raise ShardingError(f"{where}: op type {p.op_type!r}{dom} is not supported by nabla.onnx "
                                    f"(nothing was run)")
            if op is not None:
                missing = [f for f in op.needs if not hasattr(nb, f)]
                if missing and strict_ops:
                    raise ShardingError(f"{where}: op type {p.op_type!r} needs nb.{missing[0]}, which this "
                                        f"nabla does not have (nothing was run)")
                if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in p.attribute):
                    raise ShardingError(f"{where}: op type {p.op_type!r} with sub-graphs is not supported")
                if op.check is not None and strict_ops:
                    op.check(node)
            specs: dict[str, onnx.ShardingSpecProto] = {}
            for sp in node_specs(p, config_id):
                if sp.tensor_name not in p.input and sp.tensor_name not in p.output:
                    raise ShardingError(f"{where}: sharding spec names tensor {sp.tensor_name!r}, which is "
                                        f"neither an input nor an output of the node "
                                        f"(inputs {list(p.input)}, outputs {list(p.output)})")
                if sp.tensor_name in specs:
                    raise ShardingError(f"{where}: tensor {sp.tensor_name!r} has two sharding specs")
                specs[sp.tensor_name] = sp
            self.steps.append(CheckedNode(p, i, node, op, specs))


def pick_config(model: onnx.ModelProto, mesh: DeviceMesh | None) -> tuple[str | None, DeviceMesh | None]:
    """The configuration whose annotations apply, and the mesh (``mesh``, or the first configuration's)."""
    configs = list(model.configuration)
    names = [c.name for c in configs]
    annotated = [(label(p, i), c.configuration_id) for i, p in enumerate(model.graph.node)
                 for c in p.device_configurations]
    for where, cid in annotated:
        if configs and cid not in names:
            raise ShardingError(f"{where}: device configuration {cid!r} is not one of the model's "
                                f"configurations {names}")
    if mesh is None:
        if not configs:
            if annotated:
                raise ShardingError(f"{annotated[0][0]} carries sharding annotations but the model has no "
                                    f"DeviceConfigurationProto; pass mesh=")
            return None, None
        return configs[0].name, config_mesh(configs[0])
    if not configs:
        return (annotated[0][1] if annotated else None), mesh
    for c in sorted(configs, key=lambda c: c.name != mesh.name):  # the mesh's namesake first
        if c.num_devices == mesh.size:
            return c.name, mesh
    raise ShardingError(f"mesh {mesh!r} has {mesh.size} devices but the model's configurations have "
                        f"{[c.num_devices for c in configs]}")


@contextmanager
def quiet() -> Iterator[None]:
    """ONNX semantics produce inf and NaN freely (and compositions cast complex to real): no warnings."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning if hasattr(np, "exceptions")
                              else np.ComplexWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def elem_dtype(vi: onnx.ValueInfoProto) -> np.dtype | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.elem_type:
        return None
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
    except Exception:  # noqa: BLE001
        return None


def static_shape(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def shapes_only(model: onnx.ModelProto, limit: int = 4096) -> onnx.ModelProto:
    """A copy of ``model`` for shape inference: large initializers become typed graph inputs, so their bytes
    are neither copied nor serialized (ResNet-50's 100 MB took seconds); small ones, which may decide
    shapes (a Reshape's target), keep their values."""
    g = model.graph
    big = [i for i in g.initializer if np.prod(i.dims, dtype=np.int64) > limit]
    if not big:
        return model
    big_names = {i.name for i in big}
    listed = {vi.name for vi in g.input}
    typed = [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in big if i.name not in listed]
    graph = helper.make_graph(list(g.node), g.name, list(g.input) + typed, list(g.output),
                              [i for i in g.initializer if i.name not in big_names], value_info=list(g.value_info))
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = max(model.ir_version, 4)
    return out


class Walker:
    """Walks a Program's nodes over an environment of tensors; subclasses hook each node."""

    parse_note = ""  # appended to errors in annotations

    def __init__(self, prog: Program, mesh: DeviceMesh | None) -> None:
        self.prog = prog
        self.mesh = mesh
        self.env: dict[str, Tensor] = {}
        self._open: dict[int, ShardingSpec] = {}  # the open, replicated spec of each rank on the mesh
        self._inferred: dict[str, onnx.ValueInfoProto] | None = None

    def inferred(self, name: str) -> onnx.ValueInfoProto | None:
        """ONNX's own shape inference, for values nabla cannot compute without data."""
        if self._inferred is None:
            try:
                m = onnx.shape_inference.infer_shapes(shapes_only(self.prog.model))
            except Exception:  # noqa: BLE001 - inference is best effort
                m = self.prog.model
            g = m.graph
            self._inferred = {vi.name: vi for vi in list(g.value_info) + list(g.output) + list(g.input)}
        return self._inferred.get(name)

    def stand_in(self, step: CheckedNode, err: Exception) -> list[Tensor | None]:
        """Abstract outputs, replicated, shaped by ONNX's shape inference (or ``err`` if it has no shape)."""
        outs: list[Tensor | None] = []
        for name in step.proto.output:
            if not name:
                outs.append(None)
                continue
            vi = self.inferred(name)
            shape = static_shape(vi) if vi is not None else None
            if shape is None:
                raise ShardingError(f"{err} (and ONNX shape inference gives no static shape for {name!r})") from None
            t = nb.abstract(shape, elem_dtype(vi) or np.float32)
            outs.append(t.shard(self.mesh, [None] * len(shape)) if self.mesh is not None else t)
        return outs

    # -- placement --------------------------------------------------------------------------------------
    def spec_of(self, step: CheckedNode, name: str, t: Tensor) -> ShardingSpec:
        if self.mesh is None:
            raise ShardingError(f"{step.node.label}: tensor {name!r} is annotated but there is no mesh")
        try:
            return spec_from_onnx(step.specs[name], self.mesh, t.ndim, t.shape)
        except ShardingError as e:
            raise ShardingError(f"{step.node.label}: {e}{self.parse_note}") from None

    def precheck(self) -> None:
        """Parse every annotation whose tensor's rank ONNX's shape inference knows, before anything runs."""
        if self.mesh is None:
            return
        for step in self.prog.steps:
            for name, proto in step.specs.items():
                vi = self.inferred(name)
                if vi is None or not vi.type.tensor_type.HasField("shape"):
                    continue
                rank = len(vi.type.tensor_type.shape.dim)
                try:
                    spec_from_onnx(proto, self.mesh, rank, static_shape(vi))
                except ShardingError as e:
                    raise ShardingError(f"{step.node.label}: {e}{self.parse_note or ' (nothing was run)'}") from None

    def place(self, t: Tensor, spec: ShardingSpec, where: str, name: str) -> Tensor:
        if t.sharding is None:
            return t.shard(spec.mesh, spec.dim_specs)
        if t.mesh != spec.mesh:
            raise ShardingError(f"{where}: tensor {name!r} is on mesh {t.mesh!r}, its annotation on {spec.mesh!r}")
        return t.with_sharding(spec.mesh, spec.dim_specs)

    def place_initializer(self, value: np.ndarray) -> Tensor:
        value = np.asarray(value)
        value.flags.writeable = False  # a fresh array nothing else holds: wrapped as is, not copied
        t = Tensor._host(value)
        if self.mesh is None:
            return t
        spec = self._open.get(t.ndim)
        if spec is None:
            spec = self._open[t.ndim] = ShardingSpec(self.mesh, [DimSpec((), is_open=True)] * t.ndim)
        return place(t, spec, Tensor)  # t.shard(spec), without checking the spec again

    def load_initializers(self) -> None:
        for init in self.prog.graph.initializer:
            arr = numpy_helper.to_array(init)
            if not holdable(arr.dtype):
                raise ShardingError(f"initializer {init.name!r} has dtype {arr.dtype}, which nabla cannot hold")
            self.env[init.name] = self.place_initializer(arr)

    # -- the walk -----------------------------------------------------------------------------------------
    def inputs_of(self, step: CheckedNode) -> list[Tensor | None]:
        ins: list[Tensor | None] = []
        for name in step.proto.input:
            if not name:
                ins.append(None)
                continue
            if name not in self.env:
                raise ShardingError(f"{step.node.label}: input {name!r} is neither a graph input, an initializer "
                                    f"nor the output of an earlier node")
            ins.append(self.env[name])
        return ins

    def annotate_inputs(self, step: CheckedNode, ins: list[Tensor | None]) -> list[Tensor | None]:
        out = list(ins)
        for i, name in enumerate(step.proto.input):
            if name and name in step.specs and out[i] is not None:
                out[i] = self.place(out[i], self.spec_of(step, name, out[i]), step.node.label, name)
        return out

    def call(self, step: CheckedNode, ins: list[Tensor | None]) -> list[Tensor | None]:
        while ins and ins[-1] is None:
            ins = ins[:-1]
        try:
            res = step.op.run(step.node, *ins)
        except ShardingError as e:
            if str(e).startswith(step.node.label):
                raise
            raise type(e)(f"{step.node.label}: {e}") from None
        except (TypeError, ValueError) as e:  # arity, or numpy refusing a value: name the node
            raise ShardingError(f"{step.node.label}: {e}") from None
        outs = list(res) if isinstance(res, (tuple, list)) else [res]
        for i, name in enumerate(step.proto.output):
            if name and (i >= len(outs) or outs[i] is None):
                raise ShardingError(f"{step.node.label}: output {i} ({name!r}) is not produced by nabla.onnx")
        return outs

    def annotate_outputs(self, step: CheckedNode, outs: list[Tensor | None]) -> list[Tensor | None]:
        outs = list(outs)
        for i, name in enumerate(step.proto.output):
            if name and name in step.specs:
                outs[i] = self.place(outs[i], self.spec_of(step, name, outs[i]), step.node.label, name)
        return outs

    def step(self, step: CheckedNode) -> None:
        with C.user_op(step.node.op_label):  # the comm log names the ONNX node each collective serves
            ins = self.annotate_inputs(step, self.inputs_of(step))
            outs = self.annotate_outputs(step, self.call(step, ins))
        self.bind(step, outs)

    def bind(self, step: CheckedNode, outs: list[Tensor | None]) -> None:
        for name, t in zip(step.proto.output, outs):
            if name:
                self.env[name] = t

    def walk(self) -> None:
        with quiet():
            for step in self.prog.steps:
                self.step(step)


@contextmanager
def _node_errors(step: CheckedNode) -> Iterator[None]:
    """Errors of a fused op name the node it runs for, as ``Walker.call`` does."""
    try:
        yield
    except ShardingError as e:
        if str(e).startswith(step.node.label):
            raise
        raise type(e)(f"{step.node.label}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ShardingError(f"{step.node.label}: {e}") from None


def _as_tensor(value: Any, name: str, vi: onnx.ValueInfoProto | None) -> Tensor:
    if isinstance(value, Tensor):
        t = value
    else:
        dt = elem_dtype(vi) if vi is not None else None
        arr = np.asarray(value, dtype=dt)
        if not holdable(arr.dtype):
            raise ShardingError(f"input {name!r} has dtype {arr.dtype}, which nabla cannot hold")
        t = nb.tensor(arr)
    _check_shape(t.shape, name, vi)
    return t


def _check_shape(shape: tuple[int, ...], name: str, vi: onnx.ValueInfoProto | None) -> None:
    """An input must have the rank and the fixed dims the graph declares (named dims take any size), as
    onnxruntime requires."""
    if vi is None or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return
    dims = vi.type.tensor_type.shape.dim
    want = tuple(d.dim_value if d.HasField("dim_value") else None for d in dims)
    if len(want) != len(shape) or any(w is not None and w != n for w, n in zip(want, shape)):
        shown = tuple(w if w is not None else (d.dim_param or "?") for w, d in zip(want, dims))
        raise ShardingError(f"input {name!r} has shape {tuple(shape)}, but the graph declares {shown}")


class _Runner(Walker):
    """The walk ``run`` makes: a Conv -> BatchNormalization pair with constant parameters runs as one conv
    with folded weights and bias, the norm passing its input through; a conv's bias and a Relu that only it
    feeds run in the conv's kernel, and an Add (or a Sum of two) that only feeds a Relu runs with it: in the
    kernel of the conv that feeds it, when that conv runs after the Add's other operand is made (a ResNet's
    shortcut), else as one elementwise op (see ``fuse``)."""

    def __init__(self, prog: Program, mesh: DeviceMesh | None, folds: list[Fold], kept: dict | None = None) -> None:
        super().__init__(prog, mesh)
        self.kept = {} if kept is None else kept  # initializers placed and norms folded by an earlier run
        self.folds = {f.conv: f for f in folds}
        self.passthrough = {f.norm for f in folds}
        self.folded: dict[int, tuple[Tensor, Tensor]] = {}
        self.lazy: dict[str, np.ndarray | onnx.TensorProto] = {}  # initializers not placed yet
        self.relu_after: dict[int, int] = {}  # Conv, Add or Sum node -> the Relu that is its only consumer
        self.fused: set[int] = set()  # Relu nodes whose work an earlier node did (in this run)
        self.into_add: dict[int, tuple[int, int]] = {}  # Conv node -> (the Add it only feeds, operand index)
        self.summed: dict[int, int] = {}  # Add node -> the operand holding its result, a conv made it (this run)
        g = prog.graph
        consumers: dict[str, list[int]] = {}
        for k, n in enumerate(g.node):
            for x in set(n.input):
                consumers.setdefault(x, []).append(k)
        outputs = {o.name for o in g.output}

        def only_consumer(name: str) -> int | None:
            c = consumers.get(name, [])
            return c[0] if len(c) == 1 and name not in outputs else None

        for step in prog.steps:
            if step.proto.domain not in _DOMAINS or step.proto.op_type not in ("Conv", "Add", "Sum") or \
                    len(step.proto.output) != 1:
                continue
            fed = step.proto.output[0]
            k = only_consumer(fed)
            if k is not None and k in self.passthrough:  # through a folded BatchNormalization
                fed = g.node[k].output[0] if len(g.node[k].output) == 1 else None
                k = only_consumer(fed) if fed else None
            if k is None:
                continue
            relu = prog.steps[k]
            if relu.proto.op_type == "Relu" and relu.proto.domain in _DOMAINS and not relu.specs:
                self.relu_after[step.index] = k
            elif step.proto.op_type == "Conv" and relu.proto.op_type in ("Add", "Sum") and not relu.specs and \
                    relu.proto.domain in _DOMAINS and len(relu.proto.input) == 2 and len(set(relu.proto.input)) == 2:
                self.into_add[step.index] = (k, list(relu.proto.input).index(fed))
        # an Add fed by two convs: the later one adds the other's result (made by then)
        last: dict[int, int] = {}
        for c, (a, _) in self.into_add.items():
            last[a] = max(last.get(a, -1), c)
        self.into_add = {c: v for c, v in self.into_add.items() if last[v[0]] == c and v[0] in self.relu_after}

    def load_initializers(self) -> None:
        need = {p for f in self.folds.values() for p in (f.weight, f.bias, f.scale, f.shift, f.mean, f.var) if p}
        for init in self.prog.graph.initializer:
            if init.name in need or init.name in self.kept:  # read when its conv first runs (float: ``foldable``
                # checks), or placed by an earlier run
                self.lazy[init.name] = init
            else:
                arr = numpy_helper.to_array(init)
                if not holdable(arr.dtype):
                    raise ShardingError(f"initializer {init.name!r} has dtype {arr.dtype}, which nabla cannot hold")
                self.lazy[init.name] = arr  # placed when a node first reads it (folded ones never are)
            self.env[init.name] = None

    def value(self, name: str) -> np.ndarray:
        """An initializer's value, read from the model the first time it is asked for."""
        v = self.lazy[name]
        if isinstance(v, onnx.TensorProto):
            v = self.lazy[name] = numpy_helper.to_array(v)
        return v

    def inputs_of(self, step: CheckedNode) -> list[Tensor | None]:
        if step.index in self.passthrough:  # a folded norm: only its input passes, its parameters are unused
            return [self.env[step.proto.input[0]]] + [None] * (len(step.proto.input) - 1)
        f = self.folds.get(step.index)
        if f is not None and step.index not in self.folded:
            params = (f.weight, f.bias, f.scale, f.shift, f.mean, f.var)
            if step.index not in self.kept:
                self.kept[step.index] = tuple(self.place_initializer(a) for a in fold(f, {
                    p: self.value(p) for p in params if p}))
            self.folded[step.index] = self.kept[step.index]
        for name in step.proto.input:
            if name in self.lazy and not (f is not None and name in step.proto.input[1:3]):
                if name not in self.kept:
                    self.kept[name] = self.place_initializer(self.value(name))
                self.env[name] = self.kept[name]
                del self.lazy[name]
        ins = super().inputs_of(step)
        if f is not None:
            ins = ins[:1] + list(self.folded[step.index])
        return ins

    def call(self, step: CheckedNode, ins: list[Tensor | None]) -> list[Tensor | None]:
        if step.index in self.passthrough or step.index in self.fused:
            return [ins[0]]
        if step.index in self.summed:
            return [ins[self.summed[step.index]]]
        relu = self.relu_after.get(step.index)
        if step.proto.op_type == "Conv" and step.proto.domain in _DOMAINS and 2 <= len(ins) <= 3 and \
                all(t is not None for t in ins[:2]):
            b = ins[2] if len(ins) > 2 else None
            add, pos = self.into_add.get(step.index, (None, 0))
            res = self.env.get(self.prog.graph.node[add].input[1 - pos]) if add is not None else None
            if res is not None and (_layout(res) != _layout(ins[0]) or res.dtype != np.result_type(
                    *(t.dtype for t in ins if t is not None))):
                res = None  # the residual must already have the result's layout and dtype: nothing else moves
            for r in ((res, None) if res is not None else (None,)):
                try:
                    out = conv_act(step.node, ins[0], ins[1], b, relu is not None or r is not None, r)
                except ShardingError:
                    out = None  # left to the Conv entry itself, which names the node in its error
                if out is not None:
                    if relu is not None:
                        self.fused.add(relu)
                    if r is not None:
                        self.summed[add] = pos
                        self.fused.add(self.relu_after[add])
                    return [out]
        if relu is not None and step.proto.op_type in ("Add", "Sum") and len(ins) == 2 and all(t is not None for t in ins):
            a, b = ins
            self.fused.add(relu)
            with _node_errors(step):
                return [apply(ADD_RELU, (a, b))]
        return super().call(step, ins)


def _layout(t: Tensor) -> ShardingSpec | None:
    return None if t.sharding is None else t.sharding.layout()


_MEMORY_KEPT = False


def keep_freed_memory() -> None:
    """Once per process, on glibc: let freed blocks stay in the process (``mallopt`` M_MMAP_THRESHOLD 1 GiB,
    M_TRIM_THRESHOLD 2 GiB), as onnxruntime's arena keeps its memory. Otherwise every large activation and
    window buffer of a model is a fresh ``mmap`` whose pages the kernel faults in and zeroes, then returns:
    on ResNet-50 that system time was a third of the run. It changes malloc for the whole process, so it is
    opt-in: set ``NABLA_KEEP_FREED_MEMORY=1`` (the ONNX benchmarks do)."""
    global _MEMORY_KEPT
    if _MEMORY_KEPT:
        return
    _MEMORY_KEPT = True
    if os.environ.get("NABLA_KEEP_FREED_MEMORY", "0") != "1":
        return
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def run(model: Any, inputs: Mapping[str, Any], mesh: DeviceMesh | None = None) -> dict[str, Tensor]:
    """Run an ONNX model eagerly on nabla: sharded inputs keep their sharding,
    other inputs and initializers are placed replicated and open, annotations act as ``with_sharding``,
    and graph outputs come back with no partial axes."""
    return run_kept(model, inputs, mesh, None)


def run_kept(model: Any, inputs: Mapping[str, Any], mesh: DeviceMesh | None, kept: dict | None) -> dict[str, Tensor]:
    """``run``, keeping in ``kept`` (when given) the initializers it places and the norms it folds, per mesh, for
    the next run of the same model (``nox.Backend.prepare``'s rep: its session, as onnxruntime's keeps them)."""
    model = load(model)
    if not isinstance(inputs, Mapping):
        raise ShardingError(f"inputs must map graph input names to values, got {type(inputs).__name__}")
    keep_freed_memory()
    graph = model.graph
    declared = {vi.name: vi for vi in graph.input}
    unknown = [k for k in inputs if k not in declared]
    if unknown:
        raise ShardingError(f"inputs {unknown} are not graph inputs (graph inputs: {list(declared)})")
    if mesh is None:
        meshes = {v.mesh for v in inputs.values() if isinstance(v, Tensor) and v.sharding is not None}
        if len(meshes) > 1:
            raise ShardingError(f"sharded inputs are on different meshes: {sorted(map(repr, meshes))}")
        if meshes:  # sharded inputs bring their mesh
            mesh = meshes.pop()
    config_id, mesh = pick_config(model, mesh)
    given = set(inputs)
    session = None if kept is None else kept.setdefault((mesh, config_id, frozenset(given)), {})
    # the checked program and the norms that fold depend on the model, the configuration and the inputs given
    # only: kept with the session (under a tuple key, apart from its initializer names and node indices)
    if session is not None and ("program",) in session:
        prog, folds = session[("program",)]
    else:
        prog = Program(model, config_id)
        inits = {i.name for i in graph.initializer}
        missing = [n for n in declared if n not in inputs and n not in inits]
        if missing:
            raise ShardingError(f"graph inputs {missing} are not given (and have no initializer)")
        folds = foldable(model, given=given)
        if session is not None:
            session[("program",)] = (prog, folds)
    w = _Runner(prog, mesh, folds, session)
    w.precheck()
    with quiet():
        w.load_initializers()
        for name, value in inputs.items():
            t = _as_tensor(value, name, declared[name])
            if mesh is not None:
                if t.sharding is None:
                    # the ONNX sharding formalism: a model input is unsharded; placed open like any plain array, so
                    # propagation may cut it locally
                    t = t.shard(mesh, [DimSpec((), is_open=True)] * t.ndim)
                elif t.mesh != mesh:
                    raise ShardingError(f"input {name!r} is on mesh {t.mesh!r} but the model runs on {mesh!r}")
            w.env[name] = t
            w.lazy.pop(name, None)  # a given input overrides its initializer
    w.walk()
    for o in graph.output:
        if o.name in w.lazy:  # an initializer that is a graph output
            w.env[o.name] = w.place_initializer(w.value(o.name))
            del w.lazy[o.name]
    return {o.name: finish(w.env[o.name], o.name) for o in graph.output}


def finish(t: Tensor, name: str) -> Tensor:
    """The ONNX sharding formalism: a reduction's result is broadcast to all participants; no pending sums leave the graph."""
    if t is None:
        raise ShardingError(f"graph output {name!r} was not produced")
    spec = t.sharding
    if spec is not None and spec.partial_axes:
        with quiet():
            return t.with_sharding(spec.mesh, spec.dim_specs)
    return t
