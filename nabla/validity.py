"""The ONNX validity checker (the ONNX sharding formalism): is a proposed (inputs, output) sharding valid for an op?
Independent of propagation so it can test it; partial sums extend the ONNX sharding formalism's reduction rule (a sharded
reduced dim may leave its cross-device sum pending as ``partial_axes``)."""

from __future__ import annotations

from math import prod
from typing import Sequence

from .errors import ShardingError
from .spec import ShardingSpec


def _axes(spec: ShardingSpec, dim: int) -> tuple[str, ...]:
    return spec.dim_specs[dim].axes


def _uncovered(spec: ShardingSpec, axes, by) -> list[str]:
    """Axes of ``axes`` not made up of pieces in ``by`` (``x`` is made up of ``x:(1)2`` and ``x:(2)2``)."""
    refs = [spec.mesh.axis_ref(a) for a in by]
    out = []
    for a in axes:
        r = spec.mesh.axis_ref(a)
        inside = [b for b in refs if b.name == r.name and b.pre >= r.pre and b.pre * b.size <= r.pre * r.size]
        if prod(b.size for b in inside) != r.size:
            out.append(a)
    return out


def _fail(op: str, msg: str) -> ShardingError:
    return ShardingError(f"{op}: invalid sharding: {msg}")


def check_unary(inp: ShardingSpec, out: ShardingSpec, op: str = "unary") -> None:
    """No constraint on the input; the output is sharded as the input."""
    for d in range(inp.rank):
        if _axes(inp, d) != _axes(out, d):
            raise _fail(op, f"output dim {d} is {out.dim_specs[d]!r} but the input dim is {inp.dim_specs[d]!r}")


def check_broadcast(inputs: Sequence[ShardingSpec], shapes: Sequence[Sequence[int]], out: ShardingSpec,
                    out_shape: Sequence[int], op: str = "elementwise") -> None:
    """Non-broadcast dims sharded identically; size-1 broadcast dims replicated; each output shard on
    the intersection of the devices holding the input shards it needs (composition of broadcast axes)."""
    rank = len(out_shape)
    mesh = out.mesh
    for d in range(rank):
        seen = []
        for i, (spec, shape) in enumerate(zip(inputs, shapes)):
            j = d - (rank - len(shape))
            if j < 0:
                continue
            if shape[j] == 1 and out_shape[d] != 1:
                if _axes(spec, j):
                    raise _fail(op, f"operand {i} dim {j} has size 1 (broadcast) but is sharded {spec.dim_specs[j]!r}")
                continue
            seen.append((i, _axes(spec, j)))
            if _axes(spec, j) != _axes(out, d):
                raise _fail(op, f"operand {i} dim {j} is {spec.dim_specs[j]!r} but output dim {d} is {out.dim_specs[d]!r}")
        if len({a for _, a in seen}) > 1:
            raise _fail(op, f"dim {d} is sharded differently across operands: {seen}")
    # device-set composition: every device's output block is computable from its own input blocks
    for dev in mesh.devices:
        osl = out.shard_slices(out_shape, dev)
        for i, (spec, shape) in enumerate(zip(inputs, shapes)):
            isl = spec.shard_slices(tuple(shape), dev)
            for j, n in enumerate(shape):
                need = osl[j + rank - len(shape)]
                if n == 1 or need.start >= need.stop:
                    continue
                if not (isl[j].start <= need.start and need.stop <= isl[j].stop):
                    raise _fail(op, f"device {dev} must compute output rows {need.start}:{need.stop} of dim "
                                    f"{j + rank - len(shape)} but holds {isl[j].start}:{isl[j].stop} of operand {i}")


def check_reduction(inp: ShardingSpec, shape: Sequence[int], axes: Sequence[int], keepdims: bool,
                    out: ShardingSpec, op: str = "reduce") -> None:
    """Kept dims inherit the input's sharding; a kept reduced dim is unsharded; axes that sharded a
    reduced dim either are summed across devices (output replicated over them) or stay partial."""
    kept = [d for d in range(len(shape)) if d not in axes or keepdims]
    if out.rank != len(kept):
        raise _fail(op, f"output rank {out.rank}, expected {len(kept)}")
    for o, d in enumerate(kept):
        want = () if d in axes else _axes(inp, d)
        if _axes(out, o) != want:
            raise _fail(op, f"output dim {o} is {out.dim_specs[o]!r}, expected {list(want)} from input dim {d}")
    extra = _uncovered(out, out.partial_axes, [a for d in axes for a in _axes(inp, d)] + list(inp.partial_axes))
    if extra:
        raise _fail(op, f"output is partial over {sorted(extra)}, which shard no reduced dim")


def check_matmul(a: ShardingSpec, b: ShardingSpec, out: ShardingSpec, shapes: Sequence[Sequence[int]],
                 op: str = "matmul") -> None:
    """Broadcast on M (from a) and N (from b), contracted K sharded identically on both operands;
    output partial over K's axes (or reduced)."""
    sa, sb = shapes
    if _axes(a, len(sa) - 1) != _axes(b, len(sb) - 2):
        raise _fail(op, f"contracted dims differ: operand 0 dim {len(sa) - 1} is {a.dim_specs[-1]!r}, "
                        f"operand 1 dim {len(sb) - 2} is {b.dim_specs[-2]!r}")
    if _axes(out, out.rank - 2) != _axes(a, len(sa) - 2):
        raise _fail(op, f"output M dim is {out.dim_specs[-2]!r} but operand 0 M is {a.dim_specs[-2]!r}")
    if _axes(out, out.rank - 1) != _axes(b, len(sb) - 1):
        raise _fail(op, f"output N dim is {out.dim_specs[-1]!r} but operand 1 N is {b.dim_specs[-1]!r}")
    batch_out = out.rank - 2
    for d in range(batch_out):
        for i, (spec, shape) in enumerate(((a, sa), (b, sb))):
            j = d - (batch_out - (len(shape) - 2))
            if j >= 0 and shape[j] != 1 and _axes(spec, j) != _axes(out, d):
                raise _fail(op, f"batch dim {d}: operand {i} is {spec.dim_specs[j]!r}, output {out.dim_specs[d]!r}")
    extra = _uncovered(out, out.partial_axes, list(_axes(a, len(sa) - 1)) + list(a.partial_axes) + list(b.partial_axes))
    if extra:
        raise _fail(op, f"output is partial over {sorted(extra)}, which shard no contracted dim")


def valid(check, *args, **kw) -> bool:
    try:
        check(*args, **kw)
    except ShardingError:
        return False
    return True
