"""Explicit collectives for per-device code inside ``nb.shard_map``, with JAX's names and meanings: ``psum``,
``pmax``, ``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``axis_index``. Each is
simulated on every device's block at once, logged in the comm log, and lowered by ``nb.jit`` to its
``jax.lax`` twin."""

from __future__ import annotations

from math import prod
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import collectives as C
from .backends import xp as _xp
from .errors import ShardingError
from .executor import record_step
from .layout import grid
from .mesh import DeviceMesh
from .manual import ManualSpec
from .shard_map import SM_IN, SM_OUT, _axes_of, _to_manual
from .spec import ShardingSpec
from .tensor import Tensor
from .trace import link_of, recording, tracked, tracing_whole
from .shard_map import current_mesh
from .ops import arange, equal, reshape, sum as nsum


class LaxOp:
    """A collective in the trace: its name and params; ``lower(block, dev)`` is its jax.lax form (its registry
    entry's ``lower``)."""

    def __init__(self, name: str, params: tuple) -> None:
        self.name, self.params = name, params
        self.vjp = _VJPS.get(name)
        # all_gather takes its cotangent as it comes (varying along the gathered axes: a psum_scatter)
        self.raw_cotangent = name == "all_gather"

    def lower(self, x, dev):
        if self.name == "axis_index":  # a value, not a move: no registry entry
            axes, = self.params
            return dev.xp.asarray(dev.linear([dev.mesh.axis_ref(a) for a in axes]), dtype=np.int32)
        return C.REGISTRY[KINDS[self.name]].lower(x, self.params, dev)


def _manual(x: Any, fn: str) -> Tensor:
    if not isinstance(x, Tensor) or not isinstance(x.sharding, ManualSpec):
        raise ShardingError(f"nb.lax.{fn}: expects a per-device value inside nb.shard_map, got "
                            f"{type(x).__name__}" + ("" if not isinstance(x, Tensor) else f" laid out {x.sharding!r}"))
    return x


def _axes(x: Tensor, axes: Any, fn: str) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh = x.sharding.mesh
    for a in names:
        if a not in mesh.axis_names:
            raise ShardingError(f"nb.lax.{fn}: unknown mesh axis {a!r}; the mesh has {list(mesh.axis_names)}")
    if len(set(names)) != len(names) or not names:
        raise ShardingError(f"nb.lax.{fn}: axes {names} must be distinct mesh axes, at least one")
    return names


class LaxMove(NamedTuple):
    """What an nb.lax entry of the collective registry simulates: the operand's mesh, the axes it varies
    along, its block shape, and the collective's params (its axes first)."""

    mesh: DeviceMesh
    varying: tuple
    shape: tuple
    params: tuple


def _group(data, m: LaxMove):
    """The block array with the group's mesh axes full-size and merged into one leading axis (in the order
    given: JAX's linear index over several axes), plus how to put it back."""
    mesh, axes = m.mesh, m.params[0]
    G = mesh.ndim
    xp = _xp(data)
    full = tuple(mesh.shape[i] if n in axes or n in m.varying else 1 for i, n in enumerate(mesh.axis_names))
    data = xp.broadcast_to(data, full + tuple(m.shape))
    order = [mesh.axis_index(a) for a in axes]
    rest = [i for i in range(G) if i not in order]
    moved = xp.moveaxis(data, order + rest, list(range(G)))
    k = prod(mesh.shape[i] for i in order)
    merged = moved.reshape((k,) + moved.shape[len(order):])

    def back(arr):  # (k, *rest grid, *block) -> the stored grid order
        arr = arr.reshape(tuple(mesh.shape[i] for i in order) + arr.shape[1:])
        return xp.moveaxis(arr, list(range(G)), order + rest)

    return merged, k, back


def _first(m: LaxMove) -> tuple:
    """The index keeping one copy along the group's axes (the result is the same on all of them)."""
    return tuple(slice(0, 1) if n in m.params[0] else slice(None) for n in m.mesh.axis_names)


def _result(x: Tensor, shape, varying, name: str, params: tuple, k: int) -> Tensor:
    """The collective ``name`` run through its registry entry: simulated on every block, logged (over a group
    of ``k``; 0: nothing moves), recorded."""
    mesh = x.sharding.mesh
    spec = ManualSpec(mesh, varying)
    entry = C.REGISTRY[KINDS[name]]
    data = None
    if x._data is not None:
        data = entry.move(x._data, mesh.ndim, LaxMove(mesh, tuple(x.sharding.varying), x.shape, params), "")
        xp = _xp(data)
        data = xp.broadcast_to(data, spec.grid() + tuple(shape)) if data.shape != spec.grid() + tuple(shape) else data
        if xp is np:
            data = np.ascontiguousarray(data)
            data.flags.writeable = False
    op = LaxOp(name, params)
    out = Tensor(data, spec, tuple(shape), x.dtype)
    events = (C.event(KINDS[name], params[0], prod(x.shape) * x.dtype.itemsize, k),) if k else ()
    record_step(op, params, (x,), out, events, "manual", tape=tracked((x,)))
    return out


def _reduce(x, axes, name):
    x = _manual(x, name)
    axes = _axes(x, axes, name)
    k = prod(x.sharding.mesh.axis_size(a) for a in axes)
    varying = [a for a in x.sharding.varying if a not in axes]
    return _result(x, x.shape, varying, name, (axes,), k)


def _sim_reduce(fn: str):
    def move(data, G, m: LaxMove, reduce_op):
        merged, _, back = _group(data, m)
        red = getattr(_xp(merged), fn)(merged, axis=0, keepdims=True)
        return back(_xp(red).broadcast_to(red, merged.shape))[_first(m)]
    return move


def psum(x: Tensor, axes: Any) -> Tensor:
    """The sum over the devices along ``axes`` (every device gets it; a value the same on all of them is
    multiplied by their number, as in JAX)."""
    return _reduce(x, axes, "psum")


def pmax(x: Tensor, axes: Any) -> Tensor:
    return _reduce(x, axes, "pmax")


def pmin(x: Tensor, axes: Any) -> Tensor:
    return _reduce(x, axes, "pmin")


def all_gather(x: Tensor, axes: Any, axis: int = 0, *, tiled: bool = False) -> Tensor:
    """Every device's block along ``axes``, stacked as a new dim at ``axis`` (JAX's default) or, ``tiled``,
    concatenated on dim ``axis``."""
    x = _manual(x, "all_gather")
    axes = _axes(x, axes, "all_gather")
    rank = x.ndim
    if not (-rank - (not tiled) <= axis < rank + (not tiled)):
        raise ShardingError(f"nb.lax.all_gather: axis {axis} out of range for a block of rank {rank}")
    axis = axis % (rank + (not tiled))
    k = prod(x.sharding.mesh.axis_size(a) for a in axes)
    shape = list(x.shape)
    if tiled:
        shape[axis] *= k
    else:
        shape.insert(axis, k)
    varying = [a for a in x.sharding.varying if a not in axes]
    return _result(x, shape, varying, "all_gather", (axes, axis, tiled), k)


def _sim_all_gather(data, G, m: LaxMove, reduce_op):
    axes, axis, tiled = m.params
    merged, k, back = _group(data, m)
    xp = _xp(merged)
    Gr = G - len(axes)
    stacked = xp.moveaxis(merged, 0, Gr + axis)  # the group index joins the block at `axis`
    if tiled:
        s = list(stacked.shape)
        s[Gr + axis:Gr + axis + 2] = [s[Gr + axis] * s[Gr + axis + 1]]
        stacked = stacked.reshape(s)
    data = xp.expand_dims(stacked, 0)
    return back(xp.broadcast_to(data, (k,) + data.shape[1:]))[_first(m)]


def _check_split(fn: str, dim: str, n: int, k: int, axes: tuple[str, ...], tiled: bool) -> None:
    """Tiled, the dim is cut into k blocks; untiled (JAX's default), it must have one entry per device."""
    if (n % k) if tiled else (n != k):
        raise ShardingError(f"nb.lax.{fn}: {dim} of size {n} " + (
            f"does not split over {k} devices of {axes}" if tiled else
            f"is not the {k} devices of {axes} (untiled; tiled=True splits a dim into blocks)"))


def psum_scatter(x: Tensor, axes: Any, scatter_dimension: int = 0, *, tiled: bool = False) -> Tensor:
    """The sum over ``axes``, split along ``scatter_dimension``: device ``i`` of the group keeps piece ``i``.
    Untiled (JAX's default), that dim's size is the group's and the dim is removed; ``tiled``, it is divided."""
    x = _manual(x, "psum_scatter")
    axes = _axes(x, axes, "psum_scatter")
    d = scatter_dimension % max(x.ndim, 1)
    k = prod(x.sharding.mesh.axis_size(a) for a in axes)
    n = x.shape[d]
    _check_split("psum_scatter", f"dim {d}", n, k, axes, tiled)
    shape = list(x.shape)
    if tiled:
        shape[d] = n // k
    else:
        del shape[d]
    varying = sorted(set(x.sharding.varying) | set(axes))
    return _result(x, shape, varying, "psum_scatter", (axes, d, tiled), k)


def _sim_psum_scatter(data, G, m: LaxMove, reduce_op):
    axes, d, tiled = m.params
    merged, k, back = _group(data, m)
    xp = _xp(merged)
    n = m.shape[d]
    total = xp.sum(merged, axis=0, dtype=merged.dtype)  # (*rest grid, *block)
    Gr = G - len(axes)
    pieces = total.reshape(total.shape[:Gr + d] + (k, n // k) + total.shape[Gr + d + 1:])
    pieces = xp.moveaxis(pieces, Gr + d, 0)  # piece index becomes the group axis
    if not tiled:
        pieces = pieces.reshape(pieces.shape[:Gr + 1 + d] + pieces.shape[Gr + 2 + d:])
    return back(pieces)


def all_to_all(x: Tensor, axes: Any, split_axis: int, concat_axis: int, *, tiled: bool = False) -> Tensor:
    """Device ``i`` cuts its block into ``k`` pieces along ``split_axis`` and sends piece ``j`` to device
    ``j``; each device puts what it receives along ``concat_axis``, in the senders' order. Untiled (JAX's
    default), dim ``split_axis`` has size ``k`` and is removed, and the pieces stack as a new dim at
    ``concat_axis`` of the result; ``tiled``, they concatenate on dim ``concat_axis``."""
    x = _manual(x, "all_to_all")
    axes = _axes(x, axes, "all_to_all")
    s, c = split_axis % x.ndim, concat_axis % x.ndim
    k = prod(x.sharding.mesh.axis_size(a) for a in axes)
    _check_split("all_to_all", f"split dim {s}", x.shape[s], k, axes, tiled)
    shape = list(x.shape)
    if tiled:
        shape[s] //= k
        shape[c] *= k
    else:
        del shape[s]
        shape.insert(c, k)
    varying = sorted(set(x.sharding.varying) | set(axes))
    return _result(x, shape, varying, "all_to_all", (axes, s, c, tiled), k)


def _sim_all_to_all(data, G, m: LaxMove, reduce_op):
    axes, s, c, tiled = m.params
    merged, k, back = _group(data, m)  # (k senders, *rest grid, *block)
    xp = _xp(merged)
    Gr = G - len(axes)
    if tiled:
        blk = merged.shape[1 + Gr:]
        merged = merged.reshape(merged.shape[:1 + Gr + s] + (k, blk[s] // k) + merged.shape[1 + Gr + s + 1:])
    parts = xp.moveaxis(merged, 1 + Gr + s, 0)  # (k receivers, k senders, *rest grid, *block with the piece)
    parts = xp.moveaxis(parts, 1, 1 + Gr + c)  # senders at the concat dim (untiled: they are the new dim)
    if tiled:
        merged_shape = list(parts.shape)
        j = 1 + Gr + c
        merged_shape[j:j + 2] = [merged_shape[j] * merged_shape[j + 1]]
        parts = parts.reshape(merged_shape)
    return back(parts)


def ppermute(x: Tensor, axes: Any, perm: Sequence[tuple[int, int]]) -> Tensor:
    """Device ``src`` (its index along ``axes``) sends its block to device ``dst`` for each pair; devices no one
    sends to receive zeros."""
    x = _manual(x, "ppermute")
    axes = _axes(x, axes, "ppermute")
    k = prod(x.sharding.mesh.axis_size(a) for a in axes)
    perm = tuple((int(s), int(t)) for s, t in perm)
    if any(not (0 <= s < k and 0 <= t < k) for s, t in perm) or len({s for s, _ in perm}) != len(perm) or \
            len({t for _, t in perm}) != len(perm):
        raise ShardingError(f"nb.lax.ppermute: perm {list(perm)} must pair distinct sources with distinct targets "
                            f"in 0..{k - 1}")
    varying = sorted(set(x.sharding.varying) | set(axes))
    moving = [(s, t) for s, t in perm if s != t]  # a device sending to itself moves nothing
    return _result(x, x.shape, varying, "ppermute", (axes, perm), len(moving))


def _sim_ppermute(data, G, m: LaxMove, reduce_op):
    axes, perm = m.params
    merged, _, back = _group(data, m)
    xp = _xp(merged)
    out = xp.zeros_like(merged)
    src = np.array([s for s, _ in perm], dtype=np.int64)
    dst = np.array([t for _, t in perm], dtype=np.int64)
    if xp is np:
        out = np.array(out)
        out[dst] = merged[src]
    else:
        out = out.at[dst].set(merged[src])
    return back(out)


# ---- their jax.lax twins, on one device's block inside nb.jit (``dev``: the device's context) ---------------


def _names(axes, dev):
    return dev.axis_names([dev.mesh.axis_ref(a) for a in axes])


def _lower_reduce(fn: str):
    return lambda x, params, dev: getattr(dev.lax, fn)(x, _names(params[0], dev))


def _lower_all_gather(x, params, dev):
    axes, axis, tiled = params
    return dev.lax.all_gather(x, _names(axes, dev), axis=axis, tiled=tiled)


def _lower_psum_scatter(x, params, dev):
    axes, dim, tiled = params
    return dev.lax.psum_scatter(x, _names(axes, dev), scatter_dimension=dim, tiled=tiled)


def _lower_all_to_all(x, params, dev):
    axes, split, concat, tiled = params
    return dev.lax.all_to_all(x, _names(axes, dev), split, concat, tiled=tiled)


def _lower_ppermute(x, params, dev):
    axes, perm = params
    # pairs are positions along `axes`; ppermute over every atom takes mesh positions
    refs = [dev.mesh.axis_ref(a) for a in axes]
    return dev.ppermute(x, [p for s, t in perm for p in dev.pairs(lambda q, s=s, t=t: t if q == s else None, refs)])


def _wired(wire: str, field: str):
    """The wire kind's ``field`` as its registry holds it when called: an entry that replaces the wire kind
    (a tree all_gather) prices nb.lax's collective too."""
    return lambda *a: getattr(C.REGISTRY[wire], field)(*a)


#: each nb.lax collective's registry entry: logged and priced as the collective it is on the wire
KINDS = {"psum": "lax.psum", "pmax": "lax.pmax", "pmin": "lax.pmin", "all_gather": "lax.all_gather",
         "psum_scatter": "lax.psum_scatter", "all_to_all": "lax.all_to_all", "ppermute": "lax.ppermute"}
for _name, _wire, _transpose, _move, _lower in (
        ("psum", "all_reduce", "psum", _sim_reduce("sum"), _lower_reduce("psum")),
        ("pmax", "all_reduce", "pmax", _sim_reduce("max"), _lower_reduce("pmax")),
        ("pmin", "all_reduce", "pmin", _sim_reduce("min"), _lower_reduce("pmin")),
        ("all_gather", "all_gather", "psum_scatter", _sim_all_gather, _lower_all_gather),
        ("psum_scatter", "reduce_scatter", "all_gather", _sim_psum_scatter, _lower_psum_scatter),
        ("all_to_all", "all_to_all", "all_to_all", _sim_all_to_all, _lower_all_to_all),
        ("ppermute", "collective_permute", "ppermute", _sim_ppermute, _lower_ppermute)):
    C.register(C.Collective(KINDS[_name], _wired(_wire, "ring_bytes"), _wired(_wire, "ring_steps"),
                            KINDS[_transpose], _move, lower=_lower, logs_as=_wire))


def axis_index(axes: Any, like: Tensor | None = None) -> Tensor:
    """Each device's index along ``axes`` (several axes: JAX's linear index, major first), as an int32."""
    mesh = current_mesh() if like is None else like.sharding.mesh
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    probe = Tensor(np.zeros((1,) * mesh.ndim, np.int32), ManualSpec(mesh, ()), (), np.dtype(np.int32))
    names = _axes(probe, names, "axis_index")
    sizes = [mesh.axis_size(a) for a in names]
    grid = [1] * mesh.ndim
    for a, s in zip(names, sizes):
        grid[mesh.axis_index(a)] = s
    ids = np.arange(prod(sizes), dtype=np.int32).reshape(sizes)
    order = sorted(range(len(names)), key=lambda i: mesh.axis_index(names[i]))
    data = np.ascontiguousarray(ids.transpose(order)).reshape(grid)
    data.flags.writeable = False
    op = LaxOp("axis_index", (names,))
    out = Tensor(data, ManualSpec(mesh, names), (), np.dtype(np.int32))
    record_step(op, (names,), (), out, (), "manual", tape=tracing_whole())  # (nb.jit computes it on each device)
    return out


# ---- transposes (each written with these collectives, so it differentiates again) ---------------------------


def _psum_vjp(g, node, out):
    """psum of a value varying along the axes: each summand's cotangent is the (invariant) result's, no
    communication. Along axes it does not vary on, psum multiplied it by their size: so is the cotangent."""
    x, = node.args
    axes, = node.params
    mesh = x.sharding.mesh
    k = prod(mesh.axis_size(a) for a in axes if a not in x.sharding.varying)
    return (g * float(k) if k != 1 else g,)


def _own_block(g: Tensor, axes: tuple[str, ...], axis: int, tiled: bool) -> Tensor:
    """Each device's own piece of ``g`` (the same on every device of ``axes``) along ``axis``: picked with a
    one-hot of its index, no communication."""
    mesh = g.sharding.mesh
    k = prod(mesh.axis_size(a) for a in axes)
    shape = list(g.shape)
    if tiled:
        g = reshape(g, tuple(shape[:axis]) + (k, shape[axis] // k) + tuple(shape[axis + 1:]))
    hot = equal(arange(k), axis_index(axes, like=g)).astype(g.dtype)
    hot = reshape(hot, (k,) + (1,) * (g.ndim - axis - 1))
    return nsum(g * hot, axis)


def _all_gather_vjp(g, node, out):
    """all_gather's transpose: psum_scatter of a cotangent that varies along the gathered axes (the registry's
    all_gather -> reduce_scatter); of one that does not, each device's own block, with no communication."""
    x, = node.args
    axes, axis, tiled = node.params
    g = as_manual(g, x.sharding.mesh)
    other = tuple(a for a in g.sharding.varying if a not in out.sharding.varying and a not in axes)
    if other:
        g = psum(g, other)
    along = [a for a in axes if a in g.sharding.varying]
    if len(along) == len(axes):
        return (_transpose_of("all_gather")(g, axes, axis, tiled=tiled),)
    if along:
        g = psum(g, tuple(along))
    return (_own_block(g, axes, axis, tiled),)


def _transpose_of(name: str):
    """The nb.lax collective whose move is the transpose of ``name``'s, as its registry entry names it
    (all_gather <-> psum_scatter, all_to_all and ppermute their own)."""
    return {KINDS[f.__name__]: f for f in (psum_scatter, all_gather, all_to_all, ppermute)}[
        C.REGISTRY[KINDS[name]].transpose]


def _psum_scatter_vjp(g, node, out):
    """psum_scatter's transpose is all_gather (the registry's reduce_scatter -> all_gather); along axes the
    operand does not vary on, the sum multiplied it by their size, as for psum."""
    x, = node.args
    axes, d, tiled = node.params
    k = prod(x.sharding.mesh.axis_size(a) for a in axes if a not in x.sharding.varying)
    ct = _transpose_of("psum_scatter")(g, axes, d, tiled=tiled)
    return (ct * float(k) if k != 1 else ct,)


def _all_to_all_vjp(g, node, out):
    axes, s, c, tiled = node.params
    return (_transpose_of("all_to_all")(g, axes, c, s, tiled=tiled),)


def _ppermute_vjp(g, node, out):
    axes, perm = node.params
    return (_transpose_of("ppermute")(g, axes, [(t, s) for s, t in perm]),)


_VJPS = {"psum": _psum_vjp, "all_gather": _all_gather_vjp, "psum_scatter": _psum_scatter_vjp,
         "all_to_all": _all_to_all_vjp, "ppermute": _ppermute_vjp}
# pmax and pmin have no derivative (nor in JAX); axis_index has no operand


# ---- derivatives: what crosses into and out of per-device code, and the varying axes of cotangents ------------


def manual_constant(value: float, like: Tensor) -> Tensor:
    """``value`` in ``like``'s block shape and dtype, the same on every device (varying along no axis)."""
    mesh = like.sharding.mesh
    data = None
    if like._data is not None:
        data = np.full((1,) * mesh.ndim + like.shape, value, dtype=like.dtype)
        data.flags.writeable = False
    return Tensor(data, ManualSpec(mesh, ()), like.shape, like.dtype)


def as_manual(g: Tensor, mesh: DeviceMesh) -> Tensor:
    """A host cotangent of a per-device value, as a per-device value (the same block on every device)."""
    if isinstance(g.sharding, ManualSpec):
        return g
    if g.sharding is not None:
        raise ShardingError(f"grad: a global cotangent {g.sharding!r} for a per-device value inside nb.shard_map")
    if link_of(g) is not None and recording() and not tracing_whole():
        raise ShardingError("grad: a host cotangent that is itself being differentiated met a per-device value "
                            "inside nb.shard_map; this derivative cannot be differentiated again")
    data = None if g._data is None else np.asarray(g._data).reshape((1,) * mesh.ndim + g.shape)
    return Tensor(data, ManualSpec(mesh, ()), g.shape, g.dtype)


def settle(g: Tensor, v: Tensor) -> Tensor:
    """The cotangent of per-device value ``v``: where ``g`` varies along mesh axes ``v`` does not, ``v`` was used
    on every device of those axes alike, so its cotangent is the sum over them (a psum: JAX's transpose of the
    implicit broadcast of an invariant value)."""
    g = as_manual(g, v.sharding.mesh)
    extra = tuple(a for a in g.sharding.varying if a not in v.sharding.varying)
    return psum(g, extra) if extra else g


def in_vjp(g: Tensor, node: Any, out: Tensor) -> tuple:
    """Into shard_map: the per-device cotangents are the blocks of the global one. Where they vary along axes
    the in_spec does not split (the argument was copied to those devices), the global cotangent is their sum:
    left pending, as partial sums over those axes (no communication until a sum is needed)."""
    t, = node.args
    spec, = node.params
    mesh = spec.mesh
    g = as_manual(g, mesh)
    split = _axes_of(spec, "in_spec")
    extra = [a for a in g.sharding.varying if a not in split]
    gspec = ShardingSpec(mesh, spec.dim_specs, partial_axes=extra)
    data = None
    if g._data is not None:
        data = _xp(g._data).broadcast_to(g._data, ManualSpec(mesh, split + extra).grid() + g.shape).reshape(
            grid(gspec).shape + g.shape)
    res = Tensor(data, gspec, t.shape, g.dtype)
    record_step(SM_OUT, (gspec,), (g,), res, tape=tracked((g,)))
    return (res,)


def out_vjp(g: Tensor, node: Any, out: Tensor) -> tuple:
    """Out of shard_map: each device's cotangent is its block of the global one laid out as the out_spec (pending
    sums made; partial axes of the spec, from ``in_vjp``, are those blocks copied along them)."""
    spec, = node.params
    mesh = spec.mesh
    whole = ShardingSpec(mesh, [tuple(d.axes) for d in spec.dim_specs])
    if g.sharding is None:
        g = g.shard(mesh, whole.dim_specs)
    elif g.sharding.mesh != mesh:
        raise ShardingError(f"grad: a cotangent on mesh {g.sharding.mesh!r} for a shard_map output on {mesh!r}")
    else:
        g = g.with_sharding(mesh, whole.dim_specs)
    return (_to_manual(g, whole),)
