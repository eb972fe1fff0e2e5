"""``annotate``: every node's input and output specs from nabla's propagation on abstract inputs, applied
as ``with_sharding`` while walking (as ``run`` will apply them), so the annotated model reruns the same."""

from __future__ import annotations

from math import prod
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

import nabla as nb

from ..errors import ShardingError
from ..mesh import DeviceMesh
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from . import ops as O
from .graph import CheckedNode, Program, Walker, elem_dtype, load, quiet, static_shape
from .ops import NeedsValue
from .specs import spec_to_onnx


def annotate(model: Any, mesh: DeviceMesh, input_shardings: Mapping[str, Any] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` with a ``DeviceConfigurationProto`` for ``mesh`` (named after it) and every
    node's input and output specs under it. ``input_shardings`` maps graph input names to a
    ``ShardingSpec`` or a list of dim specs; other inputs are replicated (as the ONNX sharding formalism says), and open, as
    ``run`` places them."""
    src = load(model)
    if not isinstance(mesh, DeviceMesh):
        raise ShardingError(f"annotate: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if sorted(mesh.devices) != list(range(mesh.size)):
        raise ShardingError(f"annotate: ONNX device ids index a configuration's {mesh.size} devices, but mesh "
                            f"{mesh!r} has device ids {list(mesh.devices)}; use ids 0..{mesh.size - 1}")
    out = onnx.ModelProto()
    out.CopyFrom(src)
    if not any(c.name == mesh.name for c in out.configuration):
        out.configuration.append(onnx.DeviceConfigurationProto(name=mesh.name, num_devices=mesh.size))
    for c in out.configuration:
        if c.name == mesh.name and c.num_devices != mesh.size:
            raise ShardingError(f"annotate: the model's configuration {mesh.name!r} has {c.num_devices} devices, "
                                f"mesh {mesh!r} has {mesh.size}")
    if out.ir_version < 10:
        out.ir_version = 10  # device configurations arrived in IR version 10
    shardings = dict(input_shardings or {})
    g = out.graph
    inits = {i.name for i in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in inits]
    unknown = [k for k in shardings if k not in {vi.name for vi in inputs}]
    if unknown:
        raise ShardingError(f"annotate: input_shardings names {unknown}, which are not graph inputs "
                            f"({[vi.name for vi in inputs]})")
    w = _Annotator(Program(out, mesh.name), mesh)
    with quiet():
        w.load_initializers()
        for vi in inputs:
            shape = static_shape(vi)
            if shape is None:
                raise ShardingError(f"annotate: graph input {vi.name!r} needs a static shape")
            t = nb.abstract(shape, elem_dtype(vi) or np.float32)
            s = shardings.get(vi.name)
            if isinstance(s, ShardingSpec):
                if s.mesh != mesh:
                    raise ShardingError(f"annotate: input {vi.name!r} is sharded on {s.mesh!r}, not {mesh!r}")
                t = t.shard(mesh, s.dim_specs, s.replicated_axes)
            else:
                t = t.shard(mesh, [DimSpec((), is_open=True)] * len(shape) if s is None else list(s))
            for d, n in enumerate(shape):  # what nox.check would refuse is refused here, before annotating
                k = t.sharding.num_shards(d)
                if s is not None and k > max(n, 1):
                    raise ShardingError(f"annotate: input {vi.name!r} dim {d} of size {n} is split in {k} shards "
                                        f"over {list(t.sharding.dim_specs[d].axes)}; a shard count may not exceed "
                                        f"its dim (nox.check's rule: shards would hold nothing)")
            w.env[vi.name] = t
    w.walk()
    for step in w.prog.steps:
        node = g.node[step.index]
        keep = [c for c in node.device_configurations if c.configuration_id != mesh.name]
        del node.device_configurations[:]
        node.device_configurations.extend(keep)
        conf = onnx.NodeDeviceConfigurationProto(configuration_id=mesh.name)
        for name, spec in w.records[step.index].items():
            conf.sharding_spec.append(spec_to_onnx(spec, name))
        node.device_configurations.append(conf)
    try:
        onnx.checker.check_model(out)
    except onnx.checker.ValidationError as e:
        raise ShardingError(f"annotate: the annotated model does not pass onnx.checker: {e}") from None
    return out


def _closed(spec: ShardingSpec) -> ShardingSpec:
    return ShardingSpec(spec.mesh, [DimSpec(d.axes) for d in spec.dim_specs])


def _fitted(spec: ShardingSpec, shape: Sequence[int]) -> ShardingSpec:
    """``spec`` with no dim cut into more shards than it has elements, which ``nox.check`` refuses (nabla runs
    such blocks empty): a dim's last axis gives way to its major sub-axis that fits (``d`` of 4 on 2 rows:
    ``d:(1)2``, the rows held by device pairs), or leaves the dim if none does."""
    mesh, dims, changed = spec.mesh, [], False
    for d, n in zip(spec.dim_specs, shape):
        axes = list(d.axes)
        count = prod(mesh.axis_ref(a).size for a in axes)
        while axes and count > max(n, 1):
            changed = True
            ref = mesh.axis_ref(axes.pop())
            rest = count // ref.size
            fit = [k for k in range(ref.size - 1, 1, -1) if ref.size % k == 0 and rest * k <= max(n, 1)]
            if fit:
                axes.append(f"{ref.name}:({ref.pre}){fit[0]}")
            count = rest * (fit[0] if fit else 1)
        dims.append(DimSpec(tuple(axes), is_open=d.is_open))
    return ShardingSpec(mesh, dims, spec.replicated_axes) if changed else spec


class _Annotator(Walker):
    def __init__(self, prog: Program, mesh: DeviceMesh) -> None:
        super().__init__(prog, mesh)
        self.records: dict[int, dict[str, ShardingSpec]] = {}

    def spec(self, t: Tensor) -> ShardingSpec:
        return ShardingSpec.replicated(self.mesh, t.ndim) if t.sharding is None else _fitted(_closed(t.sharding),
                                                                                             t.shape)

    def put(self, t: Tensor, spec: ShardingSpec) -> Tensor:
        return t.shard(self.mesh, spec.dim_specs) if t.sharding is None else t.with_sharding(self.mesh, spec.dim_specs)

    def step(self, step: CheckedNode) -> None:
        ins = self.annotate_inputs(step, self.inputs_of(step))
        fixed = [bool(n) and n in step.specs for n in step.proto.input]
        arrived = [None if t is None else self.spec(t) for t in ins]
        want = _derive(step, ins, self.compute(step, ins), arrived, fixed, self.mesh)
        for _ in range(3):  # place the operands as derived, until that gives back the same derivation
            placed = [None if t is None else self.put(t, s) for t, s in zip(ins, want)]
            outs = self.compute(step, placed)
            new = _derive(step, placed, outs, want, fixed, self.mesh)
            if new == want:
                break
            want = new
        rec: dict[str, ShardingSpec] = {}
        for name, s in zip(step.proto.input, want):
            if name and s is not None:
                rec.setdefault(name, s)
        final = []
        for i, (name, t) in enumerate(zip(step.proto.output, outs)):
            if not name or t is None:
                final.append(t)
                continue
            s = self.spec_of(step, name, t) if name in step.specs else self.spec(t)
            final.append(self.put(t, s))
            rec[name] = _closed(s)
        self.records[step.index] = rec
        self.bind(step, final)

    def compute(self, step: CheckedNode, ins: list[Tensor | None]) -> list[Tensor | None]:
        try:
            return self.call(step, ins)
        except NeedsValue as e:
            return self.stand_in(step, e)


def _derive(step: CheckedNode, ins: Sequence[Tensor | None], outs: Sequence[Tensor | None],
            current: list[ShardingSpec | None], fixed: list[bool], mesh: DeviceMesh) -> list[ShardingSpec | None]:
    """The operand shardings the op computes with, read off its result for the ONNX sharding formalism's groups (an
    operand of an elementwise op is cut as the result is; a matmul's contracted dim carries the
    result's partial axes); other ops keep the shardings their operands arrived with."""
    out = outs[0] if outs else None
    if out is None or out.sharding is None:
        return current
    op = step.proto.op_type
    dims = [d.axes for d in out.sharding.dim_specs]
    partial = out.sharding.partial_axes
    new: list[ShardingSpec | None] = list(current)

    def set_(i: int, axes: Sequence[Sequence[str]]) -> None:
        if i < len(ins) and ins[i] is not None and not fixed[i]:
            new[i] = ShardingSpec(mesh, [tuple(a) for a in axes])

    def along(t: Tensor) -> list[tuple[str, ...]]:  # an operand broadcast against the result
        r = len(out.shape)
        return [dims[j + r - t.ndim] if t.shape[j] == out.shape[j + r - t.ndim] and t.shape[j] != 1 else ()
                for j in range(t.ndim)]

    def k_axes(ka: Tensor, ja: int, kb: Tensor, jb: int) -> tuple[str, ...]:
        for t, j in ((ka, ja), (kb, jb)):
            axes = t.sharding.dim_specs[j].axes if t.sharding is not None else ()
            if sorted(axes) == sorted(partial):
                return axes
        return tuple(partial)

    try:
        if op in O.BROADCAST or (op in O.UNARY and ins and ins[0] is not None and ins[0].shape == out.shape):
            targets = range(len(ins)) if op in O.BROADCAST else [0]
            for i in targets:
                if ins[i] is not None:
                    set_(i, along(ins[i]))
        elif op == "MatMul" and ins[0].ndim >= 2 and ins[1].ndim >= 2:
            a, b = ins[0], ins[1]
            k = k_axes(a, a.ndim - 1, b, b.ndim - 2)
            r = len(out.shape)
            batch = lambda t: [dims[j + r - t.ndim] if t.shape[j] != 1 else () for j in range(t.ndim - 2)]  # noqa: E731
            set_(0, batch(a) + [dims[-2], k])
            set_(1, batch(b) + [k, dims[-1]])
        elif op == "Gemm":
            a, b = ins[0], ins[1]
            ta, tb = step.node.attr("transA", 0), step.node.attr("transB", 0)
            k = k_axes(a, 0 if ta else 1, b, 1 if tb else 0)
            set_(0, [k, dims[0]] if ta else [dims[0], k])
            set_(1, [dims[1], k] if tb else [k, dims[1]])
            if len(ins) > 2 and ins[2] is not None:
                set_(2, along(ins[2]))
    except ShardingError:
        return current
    return new
