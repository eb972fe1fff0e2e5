"""The ONNX sharding formalism's validity checker: per op group, the input shardings a node runs with (annotated, else its
producer's, model inputs unsharded) must make sense; unannotated outputs are inferred as the ONNX sharding formalism says."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import nabla as nb

from .. import validity
from ..errors import ShardingError
from ..spec import ShardingSpec
from ..tensor import Tensor
from . import ops as O
from .graph import CheckedNode, Program, Walker, elem_dtype, finish, load, quiet, static_shape
from .ops import NeedsValue
from .specs import config_mesh


def check(model: Any) -> None:
    """Raise ``ShardingError`` naming the node, the tensor, the dim and the rule at the first sharding
    that makes no sense under the ONNX sharding formalism; return None when every configuration is valid."""
    model = load(model)
    configs = list(model.configuration)
    names = [c.name for c in configs]
    for i, p in enumerate(model.graph.node):
        for c in p.device_configurations:
            if c.configuration_id not in names:
                where = f"node {p.name!r} ({p.op_type})" if p.name else f"node #{i} ({p.op_type})"
                raise ShardingError(f"{where}: device configuration {c.configuration_id!r} is not one of the "
                                    f"model's configurations {names} (rule: every annotation names a "
                                    f"DeviceConfigurationProto)")
    for c in configs:
        _Checker(Program(model, c.name, strict_ops=False), config_mesh(c)).run()


def _axes(t: Tensor | None, dim: int) -> tuple[str, ...]:
    if t is None or t.sharding is None:
        return ()
    return t.sharding.dim_specs[dim].axes


def _shown(t: Tensor, dim: int) -> str:
    axes = _axes(t, dim)
    if not axes:
        return "replicated"
    n = t.sharding.num_shards(dim)
    return f"sharded {list(axes)} ({n} shards)"


class _Checker(Walker):
    parse_note = (" (rule: a ShardingSpecProto places every shard on devices of its configuration, each device once, "
                  "and shard counts only on dims the tensor has)")

    def run(self) -> None:
        self.precheck()
        g = self.prog.graph
        inits = {i.name for i in g.initializer}
        with quiet():
            self.load_initializers()
            for vi in g.input:
                if vi.name in inits:
                    continue
                shape = static_shape(vi)
                if shape is None:
                    raise ShardingError(f"check: graph input {vi.name!r} needs a static shape (the rules depend "
                                        f"on dim sizes)")
                dt = elem_dtype(vi) or np.dtype(np.float32)
                self.env[vi.name] = nb.abstract(shape, dt).shard(self.mesh, [None] * len(shape))
        self.walk()

    def step(self, step: CheckedNode) -> None:
        ins = self.annotate_inputs(step, self.inputs_of(step))
        self.validate(step, ins)
        for name, t in zip(step.proto.input, ins):
            if name in step.specs and t is not None:
                self.counts_fit(step, name, t)
        if step.op is None or any(not hasattr(nb, f) for f in step.op.needs):
            outs = self.stand_in(step, ShardingError(f"{step.node.label}: nabla.onnx cannot run op type "
                                                     f"{step.proto.op_type!r}"))
        else:
            try:
                outs = self.call(step, ins)
            except NeedsValue as e:
                outs = self.stand_in(step, e)
        outs = [finish(t, n) if t is not None and n not in step.specs else t
                for t, n in zip(outs, list(step.proto.output) + [""] * len(outs))]
        self.bind(step, self.annotate_outputs(step, outs))

    def annotate_outputs(self, step, outs):
        outs = super().annotate_outputs(step, outs)
        for name, t in zip(step.proto.output, outs):
            if name in step.specs:
                self.counts_fit(step, name, t)
        return outs


    # -- the rules ------------------------------------------------------------------------------------
    def counts_fit(self, step: CheckedNode, name: str, t: Tensor) -> None:
        for d in range(t.ndim):
            k = t.sharding.num_shards(d)
            if k > max(t.shape[d], 1):
                raise ShardingError(f"{step.node.label}: tensor {name!r} dim {d} of size {t.shape[d]} is split in "
                                    f"{k} shards (rule: a shard count may not exceed its dim, shards would "
                                    f"hold nothing)")

    def validate(self, step: CheckedNode, ins: list[Tensor | None]) -> None:
        op = step.proto.op_type
        names = list(step.proto.input)
        where = step.node.label
        if op in O.BROADCAST:
            _broadcast(where, names, ins, self.mesh)
        elif op in ("MatMul", "Gemm"):
            _matmul(where, step.node, names, ins, self.mesh)
        elif op == "Einsum":
            _einsum(where, step.node, names, ins)
        # unary elementwise and reductions: no constraint on the input sharding


def _spec(t: Tensor, mesh) -> ShardingSpec:
    return t.sharding if t.sharding is not None else ShardingSpec.replicated(mesh, t.ndim)


def _broadcast(where: str, names: Sequence[str], ins: Sequence[Tensor | None], mesh,
               rule: str = "broadcast n-ary") -> None:
    present = [(n, t) for n, t in zip(names, ins) if t is not None]
    out_shape = tuple(np.broadcast_shapes(*(t.shape for _, t in present)))
    rank = len(out_shape)
    natural = []
    for d in range(rank):
        ref = None
        for name, t in present:
            j = d - (rank - t.ndim)
            if j < 0:
                continue
            if t.shape[j] == 1 and out_shape[d] != 1:
                if _axes(t, j):
                    raise ShardingError(
                        f"{where}: tensor {name!r} dim {j} has size 1 and is broadcast to {out_shape[d]}, but is "
                        f"{_shown(t, j)} (rule, {rule}: a size-1 broadcast dim must be replicated across all "
                        f"devices of the node)")
                continue
            if ref is None:
                ref = (name, t, j)
            elif _axes(t, j) != _axes(ref[1], ref[2]):
                raise ShardingError(
                    f"{where}: tensor {name!r} dim {j} is {_shown(t, j)} but tensor {ref[0]!r} dim {ref[2]} is "
                    f"{_shown(ref[1], ref[2])} (rule, {rule}: non-broadcast dims must be sharded identically)")
        natural.append(_axes(ref[1], ref[2]) if ref else ())
    specs = [_spec(t, mesh) for _, t in present]
    try:
        validity.check_broadcast(specs, [t.shape for _, t in present], ShardingSpec(mesh, natural), out_shape,
                                 op=where)
    except ShardingError as e:
        msg = str(e)
        for i, (name, _) in enumerate(present):
            msg = msg.replace(f"operand {i} ", f"tensor {name!r} ")
        raise ShardingError(f"{msg} (rule, {rule}: each output shard must lie on devices holding the input "
                            f"shards it needs)") from None


def _matmul(where: str, node: O.Node, names, ins, mesh) -> None:
    a, b = ins[0], ins[1]
    na, nb_ = names[0], names[1]
    rule = "MatMul-like"
    if node.op_type == "Gemm":
        ka = 0 if node.attr("transA", 0) else 1
        kb = 1 if node.attr("transB", 0) else 0
        ma, nbd = 1 - ka, 1 - kb
    else:
        ka = a.ndim - 1
        kb = 0 if b.ndim == 1 else b.ndim - 2
    if _axes(a, ka) != _axes(b, kb):
        raise ShardingError(
            f"{where}: the contracted dim K is {_shown(a, ka)} on tensor {na!r} (dim {ka}) but {_shown(b, kb)} "
            f"on tensor {nb_!r} (dim {kb}) (rule, {rule}: the two reduction axes must be sharded identically)")
    if node.op_type == "Gemm":
        c = ins[2] if len(ins) > 2 else None
        if c is not None:
            stub = nb.abstract((a.shape[ma], b.shape[nbd]), c.dtype).shard(mesh, [_axes(a, ma), _axes(b, nbd)])
            _broadcast(where, [f"{na} x {nb_}", names[2]], [stub, c], mesh, rule="Gemm's C, broadcast n-ary")
        return
    if a.ndim > 2 or b.ndim > 2:  # batch dims broadcast against each other
        def batch_of(t):
            return nb.abstract(t.shape[:-2], t.dtype).shard(mesh, [_axes(t, d) for d in range(t.ndim - 2)])
        ba = batch_of(a) if a.ndim > 2 else None
        bb = batch_of(b) if b.ndim > 2 else None
        _broadcast(where, [na, nb_], [ba, bb], mesh, rule="MatMul-like batch dims, broadcast n-ary")
    if a.ndim >= 2 and b.ndim >= 2:
        sa, sb = _spec(a, mesh), _spec(b, mesh)
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        batch = []
        for d in range(len(shape) - 2):
            axes = ()
            for t in (a, b):
                j = d - (len(shape) - t.ndim)
                if j >= 0 and t.shape[j] != 1:
                    axes = _axes(t, j)
            batch.append(axes)
        out = ShardingSpec(mesh, batch + [_axes(a, a.ndim - 2), _axes(b, b.ndim - 1)], partial_axes=_axes(a, ka))
        try:
            validity.check_matmul(sa, sb, out, [a.shape, b.shape], op=where)
        except ShardingError as e:
            msg = str(e).replace("operand 0 ", f"tensor {na!r} ").replace("operand 1 ", f"tensor {nb_!r} ")
            raise ShardingError(f"{msg} (rule, {rule})") from None


def _einsum(where: str, node: O.Node, names, ins) -> None:
    eq = node.attr("equation").replace(" ", "")
    terms = eq.partition("->")[0].split(",")
    seen: dict[str, tuple[str, Tensor, int]] = {}
    for name, t, term in zip(names, ins, terms):
        ell = t.ndim - (len(term) - 3) if "..." in term else 0
        dims = term.replace("...", "." * ell)
        for j, c in enumerate(dims):
            key = c if c != "." else f"...{ell - dims[:j].count('.')}"  # ellipsis dims align from the right
            if t.shape[j] == 1 and c == ".":
                if _axes(t, j):
                    raise ShardingError(f"{where}: tensor {name!r} dim {j} has size 1 and is broadcast, but is "
                                        f"{_shown(t, j)} (rule, MatMul-like (Einsum): a broadcast dim must be "
                                        f"replicated)")
                continue
            if key in seen:
                n0, t0, j0 = seen[key]
                if _axes(t, j) != _axes(t0, j0):
                    raise ShardingError(
                        f"{where}: letter {c!r} is {_shown(t, j)} on tensor {name!r} dim {j} but {_shown(t0, j0)} "
                        f"on tensor {n0!r} dim {j0} (rule, MatMul-like (Einsum): every occurrence of an index must "
                        f"be sharded identically)")
            else:
                seen[key] = (name, t, j)
