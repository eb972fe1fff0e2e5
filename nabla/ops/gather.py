"""Gathers by integer indices (``take``, ``take_along_axis``, and ``x[ids]`` through ``getitem``) and the
scatter-adds of their gradients. The indices' dims pass through; a gathered dim sharded over mesh axes is never
gathered: each device looks up the indices its rows hold (zeros for the others) and the result is a pending sum
over those axes, as Megatron's vocabulary-parallel embedding does. Masks whose result shape depends on data are
refused with a pointer to ``where``."""

from __future__ import annotations

import functools
from math import prod
from typing import Any, Callable

import numpy as np

from .. import backends, storage
from .. import rules as R
from ..backends import xp as _xp
from ..collectives import user_op as _user_op
from ..errors import ShardingError, ShardingIndexError
from ..value import Value
from ..opdef import OpDef
from ..spec import DimSpec
from .core import ArrayLike, Tensor, _axes, apply, _is_diff, _ndim, _shape
from .pointwise import maximum, minimum
from .registry import onnx_export, register
from .shape import broadcast_to, reshape

# ---- the row numbers of a gathered dim --------------------------------------------------------------------------
# Every gather and scatter takes, as its third operand, the 1-based numbers of the gathered dim's rows
# (``arange(1, n + 1)``) laid out as that dim: a device reads off which rows it holds (its offset), and padding
# (0) holds none. A host value, so a gather of a sharded table slices it locally: nothing moves.


@functools.lru_cache(maxsize=256)
def _row_numbers(n: int) -> np.ndarray:
    rows = np.arange(1, n + 1, dtype=np.int32 if n < 2 ** 31 - 1 else np.int64)
    rows.flags.writeable = False
    return rows


def _rows_like(x: Any, axis: int) -> Any:
    """The row numbers of ``x``'s dim ``axis``, laid out (closed) as that dim is: a gradient lands in ``x``'s rows."""
    rows = _row_numbers(_shape(x)[axis])
    spec = x._spec if isinstance(x, Value) else None
    if spec is None:
        return rows
    return Tensor._host(rows).shard(spec.mesh, [DimSpec(spec.dim_specs[axis].axes)])


def _free(t: Any, refs: tuple) -> Any:
    """``t`` with the mesh axes ``refs`` out of its dims (each dim keeps the axes before the first that overlaps one:
    an all_gather of the indices, small next to the table). The table keeps its gathered dim's axes, which a
    factor of the result would otherwise win (and gather the table)."""
    spec = t._spec if isinstance(t, Value) else None
    if spec is None or not refs:
        return t
    dims, changed = [], False
    for ds, rs in zip(spec.dim_specs, spec.dim_refs):
        keep = []
        for r in rs:
            if any(r.overlaps(q) for q in refs):
                changed = True
                break
            keep.append(str(r))
        dims.append(DimSpec(tuple(keep)) if len(keep) < len(rs) else ds)  # closed: an open dim would keep them
    if not changed:
        return t
    return t.with_sharding(spec.mesh, dims, spec.replicated_axes, spec.partial_axes)


# ---- kernels: blocks with the grid axes in front (G of them), numpy or jax.numpy -------------------------------


def _as_index(xp: Any, ids: Any, n: int) -> Any:
    """Indices as int64, negative ones counted from the end (as numpy's take does)."""
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    return xp.where(ids < 0, ids + n, ids)


def _gather(xp: Any, x: Any, G: int, axis: int, idx: Any) -> Any:
    """``x`` of blocks ``(*grid, *pre, c, *post)`` indexed by ``idx`` of ``(*grid, *I)`` (in ``[0, c)``) along
    ``axis``, per grid position: ``(*grid, *pre, *I, *post)``."""
    ni = idx.ndim - G
    xt = xp.moveaxis(x, G + axis, G) if axis else x
    index = tuple(xp.arange(s).reshape((1,) * j + (s,) + (1,) * (G - j - 1 + ni)) if s > 1 else 0
                  for j, s in enumerate(x.shape[:G]))
    out = xt[index + (idx,)]  # (*grid, *I, *pre, *post): the advanced indices lead
    if axis and ni:
        rest = out.ndim - G - ni - axis
        out = out.transpose(tuple(range(G)) + tuple(range(G + ni, G + ni + axis)) + tuple(range(G, G + ni)) +
                            tuple(range(G + ni + axis, G + ni + axis + rest)))
    return out


def _local_ids(xp: Any, ids: Any, rows: Any, G: int, n: int) -> tuple[Any, Any]:
    """Each device's indices into the rows it holds, and where an index is one of them (None: every device holds
    every row, and the indices were checked). ``rows`` holds the 1-based numbers of the device's rows (0 in
    padding)."""
    c = rows.shape[-1]
    if c == n and not any(s > 1 for s in rows.shape[:G]):
        if xp is np:  # checked in range before the op ran
            return ids, None
        hit = (ids >= 0) & (ids < n)  # under nb.jit nothing was checked: an index out of range gives zeros
        return xp.where(hit, ids, 0), hit
    ni = ids.ndim - G
    first = rows[..., :1].reshape(rows.shape[:G] + (1,) * ni)
    local = ids - (first.astype(np.int64) - 1)
    inside = (local >= 0) & (local < c)
    local = xp.where(inside, local, 0)
    hit = inside & (_gather(xp, rows, G, 0, local).astype(np.int64) == ids + 1)
    return xp.where(hit, local, 0), hit


def _masked(xp: Any, out: Any, hit: Any, G: int, before: int, after: int) -> Any:
    """Zeros where ``hit`` (of the indices' dims) is False; ``before``/``after``: the result's dims around them."""
    if hit is None:
        return out
    h = hit.reshape(hit.shape[:G] + (1,) * before + hit.shape[G:] + (1,) * after)
    return xp.where(h, out, xp.zeros((), out.dtype))


def _indexed(arrays, local) -> tuple:
    """What every gather and scatter kernel starts from: the array namespace, G, the axis, the data block, and
    the device's local indices with where they hit its rows."""
    x, ids, rows = arrays
    axis, n = local.params
    xp = _xp(x, ids, rows)
    idx, hit = _local_ids(xp, _as_index(xp, ids, n), rows, local.G, n)
    return xp, local.G, axis, x, idx, hit


def _take_kernel(arrays, local):
    xp, G, axis, x, idx, hit = _indexed(arrays, local)
    if x.shape[G + axis] == 0:  # nothing to take from (the indices are empty: numpy refuses any other)
        return xp.zeros((1,) * G + local.out_chunk, x.dtype)
    out = _gather(xp, x, G, axis, idx)
    return _masked(xp, out, hit, G, axis, x.ndim - G - axis - 1)


def _scatter_add(xp: Any, out: Any, index: tuple, values: Any) -> Any:
    if xp is np:
        if out.dtype.kind == "f" and out.dtype.itemsize < 4 or out.dtype.kind == "V":
            wide = out.astype(np.float32)  # bfloat16, float16: accumulate in float32, round once
            np.add.at(wide, index, values.astype(np.float32))
            return wide.astype(out.dtype)
        np.add.at(out, index, values)
        return out
    return out.at[index].add(values)


def _scatter_kernel(arrays, local):
    """The transpose of ``take``: each update added into the row its index names, on the device holding it."""
    xp, G, axis, g, idx, hit = _indexed(arrays, local)
    rows = arrays[2]
    ni = idx.ndim - G
    rest = g.ndim - G - ni
    if axis and ni:  # the indices' dims lead, then the table's other dims
        g = g.transpose(tuple(range(G)) + tuple(range(G + axis, G + axis + ni)) + tuple(range(G, G + axis)) +
                        tuple(range(G + axis + ni, g.ndim)))
    g = _masked(xp, g, hit, G, 0, rest)
    grid = tuple(np.broadcast_shapes(g.shape[:G], idx.shape[:G], rows.shape[:G]))
    c = rows.shape[-1]
    out = xp.zeros(grid + (c,) + g.shape[G + ni:], g.dtype)
    index = tuple(xp.arange(s).reshape((1,) * j + (s,) + (1,) * (G - j - 1 + ni)) if s > 1 else 0
                  for j, s in enumerate(grid)) + (idx,)
    out = _scatter_add(xp, out, index, g)
    return xp.moveaxis(out, G, G + axis) if axis else out


def _take_along_kernel(arrays, local):
    xp, G, axis, arr, idx, hit = _indexed(arrays, local)
    rank = arr.ndim - G
    if arr.shape[G + axis] == 0:
        return xp.zeros((1,) * G + local.out_chunk, arr.dtype)
    grid = tuple(np.broadcast_shapes(arr.shape[:G], idx.shape[:G]))
    arr = xp.broadcast_to(arr, grid + arr.shape[G:])
    idx = xp.broadcast_to(idx, grid + idx.shape[G:])
    out = xp.take_along_axis(arr, idx, axis=G + axis)
    return _masked(xp, out, hit, G, 0, 0) if rank else out


def _scatter_along_kernel(arrays, local):
    """The transpose of ``take_along_axis``: each update added at its index along ``axis``."""
    xp, G, axis, g, idx, hit = _indexed(arrays, local)
    rows = arrays[2]
    g = _masked(xp, g, hit, G, 0, 0)
    grid = tuple(np.broadcast_shapes(g.shape[:G], idx.shape[:G], rows.shape[:G]))
    shape = list(g.shape[G:])
    shape[axis] = rows.shape[-1]
    out = xp.zeros(grid + tuple(shape), g.dtype)
    full = grid + tuple(shape)
    index = []
    for j, s in enumerate(full):
        if j == G + axis:
            index.append(idx)
        elif s > 1:
            index.append(xp.arange(s).reshape((1,) * j + (s,) + (1,) * (len(full) - j - 1)))
        else:
            index.append(0)
    return _scatter_add(xp, out, tuple(index), g)


# ---- VJPs (nabla ops: the backward pass shards like any code) ----------------------------------------------


def _cast_like(g: Tensor, x: Any) -> Tensor:
    return g if g.dtype == x._dtype else g.astype(x._dtype)


def _gather_vjp(scatter: Callable[[], OpDef]) -> Callable:
    """A gather's VJP: the cotangent (laid out as the result) scatter-added into the table's rows, which come in
    the table's layout: local on each device, indices that conflict with the table's axes gathered first."""
    def vjp(g, node, out):
        x, ids, _ = node.args
        if not _is_diff(x):
            return None, None, None
        axis, n = node.params
        refs = _gathered_refs(x, axis)
        return _cast_like(apply(scatter(), (_free(g, refs), _free(ids, refs), _rows_like(x, axis)), (axis, n)), x), \
            None, None
    return vjp


def _scatter_vjp(gather: Callable[[], OpDef]) -> Callable:
    """A scatter-add's VJP: the gather of the cotangent at the same indices."""
    def vjp(g, node, out):
        u, ids, _ = node.args
        if not _is_diff(u):
            return None, None, None
        axis, n = node.params
        return _cast_like(apply(gather(), (g, ids, _row_numbers(n)), (axis, n)), u), None, None
    return vjp


# ---- ONNX ---------------------------------------------------------------------------------------------------


@onnx_export("Gather")
def _take_onnx(ex):
    x, ids = ex.operand(0), ex.operand(1, np.int64)
    return ex.finish(ex.out("Gather", [x, ids], axis=int(ex.params[0])), [(x, 0), (ids, 1)])


@onnx_export("GatherElements")
def _take_along_onnx(ex):
    x, ids = ex.operand(0), ex.operand(1, np.int64)
    return ex.finish(ex.out("GatherElements", [x, ids], axis=int(ex.params[0])), [(x, 0), (ids, 1)])


def _zeros_onnx(ex, shape) -> str:
    return ex.emit("Expand", [ex.b.constant(np.zeros((), ex.dtype), base="zero"), ex.ints(shape)], "zeros")


def _nonnegative_onnx(ex, ids: str, n: int) -> str:
    """Indices with the negative ones counted from the end (ScatterND takes none)."""
    size = ex.ints([n], "rows")
    neg = ex.emit("Less", [ids, ex.ints([0], "zero")], "negative")
    return ex.emit("Where", [neg, ex.emit("Add", [ids, size], "wrapped"), ids], "index")


@onnx_export("ScatterND", "Transpose", "Unsqueeze", "Expand", "Where", "Less", "Add")
def _scatter_onnx(ex):
    """ScatterND adds along leading dims: the indices' dims and the gathered dim are moved in front, then back."""
    axis, n = ex.params
    g, ids = ex.operand(0, ex.dtype), ex.operand(1, np.int64)
    shape = tuple(ex.v.shape)
    ni = len(_shape(ex.args[1]))
    rank = len(shape)
    perm = list(range(axis, axis + ni)) + list(range(axis)) + list(range(axis + ni, rank - 1 + ni))
    u = ex.emit("Transpose", [g], "updates", perm=perm) if perm != sorted(perm) else g
    moved = (n,) + shape[:axis] + shape[axis + 1:]
    idx = ex.emit("Unsqueeze", [_nonnegative_onnx(ex, ids, n), ex.ints([-1], "axes")], "indices")
    data = _zeros_onnx(ex, moved)
    back = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    if back == list(range(rank)):
        return ex.finish(ex.out("ScatterND", [data, idx, u], reduction="add"), [(g, 0), (ids, 1)])
    s = ex.emit("ScatterND", [data, idx, u], "scattered", reduction="add")
    return ex.finish(ex.out("Transpose", [s], perm=back), [(g, 0), (ids, 1)])


@onnx_export("ScatterElements", "Expand")
def _scatter_along_onnx(ex):
    axis, n = ex.params
    g, ids = ex.operand(0, ex.dtype), ex.operand(1, np.int64)
    data = _zeros_onnx(ex, tuple(ex.v.shape))
    return ex.finish(ex.out("ScatterElements", [data, ids, g], axis=int(axis), reduction="add"),
                     [(g, 0), (ids, 1)])


# ---- the public functions ----------------------------------------------------------------------------------


def _indices(ids: Any, op: str) -> Any:
    """The indices operand: a tensor, or a host array (a Python int or list made one); integers (bools count as
    0 and 1, as numpy's take counts them)."""
    if not isinstance(ids, Value):
        ids = np.asarray(ids)
        if ids.dtype == object or ids.dtype.kind not in "biu" and not (ids.size == 0 and ids.dtype.kind == "f"):
            raise ShardingError(f"{op}: indices must be integers, got an array of dtype {ids.dtype}")
        if ids.dtype.kind == "f":  # numpy reads an empty list as float64: as indices it is empty
            ids = ids.astype(np.int64)
        ids = ids.copy()
        ids.flags.writeable = False
        return ids
    if ids._dtype.kind not in "biu":
        raise ShardingError(f"{op}: indices must be integers, got a tensor of dtype {ids._dtype} and shape "
                            f"{ids._shape}")
    if ids._spec is not None and ids._spec.partial_axes:  # summed here, so their range can be checked
        ids = ids.with_sharding(ids._spec.mesh, ids._spec.dim_specs, ids._spec.replicated_axes)
    return ids


def _check_range(ids: Any, n: int, axis: int, op: str) -> None:
    """numpy's IndexError for an index outside ``[-n, n)``: each device checks the indices it holds (padding
    aside), so nothing moves. Abstract indices (``nb.abstract``, ``nb.jit``'s trace) are not checked."""
    if isinstance(ids, Value):
        data, spec = ids._data, ids._spec
        if data is None:
            return
        if spec is not None:
            for d in range(len(ids._shape)):
                regions = storage.pad_regions(spec, ids._shape, d)
                if regions:
                    data = storage.fill(data, regions, 0)
    else:
        data = ids
    if data.size == 0 or data.dtype.kind == "b":
        return
    xp = backends.xp(data)
    bad = (data < -n) | (data >= n)
    if bool(xp.any(bad)):
        first = backends.to_host(data)[backends.to_host(bad)][0]
        if n == 0:
            raise ShardingIndexError(f"{op}: cannot take index {first} from dim {axis} of size 0")
        raise ShardingIndexError(f"{op}: index {first} is out of bounds for axis {axis} with size {n}")


def _gathered_refs(x: Any, axis: int) -> tuple:
    spec = x._spec if isinstance(x, Value) else None
    return spec.dim_refs[axis] if spec is not None else ()


def take(a: ArrayLike, indices: ArrayLike, axis: int | None = None, mode: str | None = None) -> Tensor:
    """numpy's ``take``: ``a``'s elements at ``indices`` along ``axis`` (flattened when None); the result has
    ``a``'s dims with ``axis`` replaced by the indices' dims. ``mode``: ``"raise"`` (numpy's default; also
    None) or ``"clip"``, as numpy's. An index out of range raises ``IndexError`` (a
    ``ShardingError``) when the indices hold values; under ``nb.jit`` nothing is checked and such an index gives
    zeros (jax clamps it instead).

    Sharding: the indices' dims pass through to the result, and so do ``a``'s other dims. When ``a``'s dim
    ``axis`` is sharded over mesh axes, it stays so: each device looks up the indices its rows hold, zeros for
    the others, and the result is a pending sum over those axes (Megatron's vocabulary-parallel embedding),
    summed when a later op needs it, once, by one all_reduce (or a reduce_scatter when that op shards it).
    Indices sharded on those same axes are gathered first (they are the smaller operand). The gradient of
    ``a`` is local: each device adds the incoming rows into the rows it holds."""
    if axis is None:
        if _ndim(a) != 1:
            a = reshape(a, (-1,))
        axis = 0
    ax = _axes(axis, _ndim(a), "take")
    if not ax:
        raise ShardingError(f"take: a 0-d value has no dim {axis} to take from")
    ax = ax[0]
    n = _shape(a)[ax]
    with _user_op("take"):
        ids = _indices(indices, "take")
        if mode == "clip" and n:
            ids = _clipped(ids, n)
        elif mode not in (None, "raise", "clip"):
            raise ShardingError(f"take: mode must be 'raise' or 'clip', got {mode!r}")
        _check_range(ids, n, ax, "take")
        return apply(_TAKE, (a, ids, _row_numbers(n)), (ax, n))  # _one_side_gives_way first (its arrange)


def _take_arrange(vals: list, params: tuple) -> tuple:
    """``take``'s operands as it looks them up (``OpDef.arrange``): one side of a shared mesh axis gives way."""
    a, ids = _one_side_gives_way(vals[0], vals[1], params[0])
    return a, ids, vals[2]


def _ids_give_way(vals: list, params: tuple) -> tuple:
    """``take_along_axis``'s operands (``OpDef.arrange``): indices cut over the axes of the table's dim they
    index are gathered over them (each device looks up along the rows it holds)."""
    return vals[0], _free(vals[1], _gathered_refs(vals[0], params[0])), vals[2]


def _one_side_gives_way(a: Any, ids: Any, ax: int) -> tuple:
    """Table rows and indices cut over the same mesh axes (FSDP: the embedding's rows and the batch both on
    ``dp``): one side gives those axes up, whichever sends fewer bytes per device. Gathering the table's rows
    sends ``(k-1)/k`` of its block with them (ZeRO-3 gathering a weight while it is used); gathering the indices
    sends ``(k-1)/k`` of theirs and leaves the lookup a pending sum over those axes, ``2(k-1)/k`` of it when it
    is summed (Megatron's vocabulary-parallel embedding, the better plan for a large vocabulary)."""
    refs = _gathered_refs(a, ax)
    ispec = ids._spec if isinstance(ids, Value) else None
    if not refs or ispec is None:
        return a, ids
    shared = tuple(r for r in refs if any(r.overlaps(q) for rs in ispec.dim_refs for q in rs))
    if not shared:
        return a, ids
    aspec, shape = a._spec, _shape(a)
    k = prod(r.size for r in shared)
    a_cuts = prod(aspec.num_shards(d) for d in range(len(shape)))
    table = prod(shape) * a._dtype.itemsize * k / a_cuts  # the table's block once the rows are gathered
    ids_after = prod(_shape(ids)) * k / prod(ispec.num_shards(d) for d in range(len(ispec.dim_specs)))
    row = prod(shape) / max(shape[ax], 1) * aspec.num_shards(ax) / a_cuts  # one row's elements on a device
    lookup = ids_after * ids._dtype.itemsize + 2 * ids_after * row * a._dtype.itemsize
    if table <= lookup:
        return _free(a, shared), ids
    return a, _free(ids, refs)


def _clipped(ids: Any, n: int) -> Any:
    """numpy's ``mode="clip"``: indices past either end name the end (negative ones name row 0)."""
    if not isinstance(ids, Value):
        return np.clip(ids, 0, n - 1)
    return minimum(maximum(ids, 0), n - 1)


def take_along_axis(arr: ArrayLike, indices: ArrayLike, axis: int | None = -1) -> Tensor:
    """numpy's ``take_along_axis``: ``out[..., j, ...] = arr[..., indices[..., j, ...], ...]`` along ``axis`` (the
    other dims broadcast; ``axis=None``: on the flattened array with 1-D indices). Out-of-range indices raise
    ``IndexError`` as numpy's do (under ``nb.jit``: zeros).

    Sharding as ``take``: the other dims pass through; ``arr``'s dim ``axis`` sharded over mesh axes stays so, each
    device picking the elements its rows hold (zeros elsewhere), the result a pending sum over those axes. So
    picking each token's target logit from logits sharded on the vocabulary moves nothing; only the per-token
    sum is made, when needed. The gradient of ``arr`` is local."""
    if axis is None:
        if _ndim(indices) != 1:
            raise ShardingError(f"take_along_axis: with axis=None the indices must be 1-D, got shape "
                                f"{_shape(indices)}")
        arr = reshape(arr, (-1,)) if _ndim(arr) != 1 else arr
        axis = 0
    rank = _ndim(arr)
    with _user_op("take_along_axis"):
        ids = _indices(indices, "take_along_axis")
        if _ndim(ids) != rank:
            raise ShardingError(f"take_along_axis: indices of rank {_ndim(ids)} for an array of rank {rank}; they "
                                f"must have the same rank")
        ax = _axes(axis, rank, "take_along_axis")
        if not ax:
            raise ShardingError("take_along_axis: a 0-d array has no axis to take along")
        ax = ax[0]
        sa, si = _shape(arr), _shape(ids)
        out = []
        for d, (p, q) in enumerate(zip(sa, si)):
            if d != ax and p != q and 1 not in (p, q):
                raise ShardingError(f"take_along_axis: shapes {sa} and {si} do not broadcast at dim {d} ({p} vs "
                                    f"{q})")
            out.append((q if p == 1 else p) if d != ax else None)
        if any(p != o for d, (p, o) in enumerate(zip(sa, out)) if d != ax):
            arr = broadcast_to(arr, tuple(o if d != ax else sa[d] for d, o in enumerate(out)))
        if any(q != o for d, (q, o) in enumerate(zip(si, out)) if d != ax):
            ids = broadcast_to(ids, tuple(o if d != ax else si[d] for d, o in enumerate(out)))
        n = sa[ax]
        _check_range(ids, n, ax, "take_along_axis")
        return apply(_TAKE_ALONG, (arr, ids, _row_numbers(n)), (ax, n))  # _ids_give_way first (its arrange)


def scatter_add(updates: ArrayLike, indices: ArrayLike, n: int, axis: int = 0, like: ArrayLike | None = None
                ) -> Tensor:
    """The transpose of ``take``: a tensor whose dim ``axis`` has ``n`` rows, zero but for ``updates``
    (``(*pre, *indices.shape, *post)``) added into the row each index names (``jax.lax.scatter_add`` of whole
    rows: an embedding's gradient). Internal (no ``nb.scatter_add``; ``nb.import_jax`` runs JAX's scatter-add as
    it). ``like``: a tensor whose dim ``axis`` is laid out as the result's rows are to be (each device adds the
    updates for the rows it holds); default: the rows are open to propagation."""
    rows = _rows_like(like, axis) if like is not None and _shape(like)[axis] == n else _row_numbers(n)
    return apply(_SCATTER, (updates, _indices(indices, "scatter_add"), rows), (axis, n))


def scatter_add_along(updates: ArrayLike, indices: ArrayLike, n: int, axis: int) -> Tensor:
    """The transpose of ``take_along_axis``: ``updates`` added at each index along ``axis`` (of ``n`` rows) of a
    zero tensor of their shape otherwise; ``indices`` has the updates' shape. Internal, as ``scatter_add``."""
    return apply(_SCATTER_ALONG, (updates, _indices(indices, "scatter_add_along"), _row_numbers(n)), (axis, n))


def _data_dependent(op: str, a: ArrayLike) -> ShardingError:
    return ShardingError(f"{op}: the positions of the nonzero elements of a value of shape {tuple(_shape(a))} are as "
                         f"many as its values make them, so the result has no static shape (numpy's {op}, "
                         f"where(mask) and t[mask]) and no sharding; use nb.where(mask, t, fill), which keeps the "
                         f"shape and the sharding")


def nonzero(a: ArrayLike) -> Tensor:
    """numpy's ``nonzero`` has a result whose shape depends on the values: refused (a ``ShardingError`` pointing
    to ``nb.where(mask, t, fill)``, which keeps the shape)."""
    raise _data_dependent("nonzero", a)


def argwhere(a: ArrayLike) -> Tensor:
    """Refused as ``nonzero`` is: its result's shape depends on the values."""
    raise _data_dependent("argwhere", a)


def flatnonzero(a: ArrayLike) -> Tensor:
    """Refused as ``nonzero`` is: its result's shape depends on the values."""
    raise _data_dependent("flatnonzero", a)


def _IDS(diff: tuple, params: tuple) -> tuple:
    """A gather and a scatter-add keep their indices only (for the operand's cotangent)."""
    return ((1,) if diff[0] else ()), False


_TAKE = register(OpDef("take", lambda shapes, axis, n: R.take_rule(shapes[0], shapes[1], shapes[2], axis),
                       _take_kernel, "add", (0,), dtype=lambda x, ids, rows: x, vjp=_gather_vjp(lambda: _SCATTER), numpy="take",
                       onnx=_take_onnx, arity=3, public=take, flops=lambda blocks, out, params: 0, saves=_IDS,
                       arrange=_take_arrange))
_SCATTER = register(OpDef("scatter_add", lambda shapes, axis, n: R.scatter_rule(shapes[0], shapes[1], shapes[2],
                                                                                   axis),
                          _scatter_kernel, "add", (0,), dtype=lambda g, ids, rows: g, vjp=_scatter_vjp(lambda: _TAKE),
                          onnx=_scatter_onnx, arity=3, flops=lambda blocks, out, params: prod(blocks[0]), saves=_IDS))
_TAKE_ALONG = register(OpDef("take_along_axis", lambda shapes, axis, n: R.take_along_rule(shapes[0], shapes[1],
                                                                                          shapes[2], axis),
                             _take_along_kernel, "add", (0,), dtype=lambda x, ids, rows: x, vjp=_gather_vjp(lambda: _SCATTER_ALONG),
                             numpy="take_along_axis", onnx=_take_along_onnx, arity=3, public=take_along_axis,
                             flops=lambda blocks, out, params: 0, saves=_IDS, arrange=_ids_give_way))
_SCATTER_ALONG = register(OpDef("scatter_add_along", lambda shapes, axis, n: R.scatter_along_rule(
    shapes[0], shapes[1], shapes[2], axis), _scatter_along_kernel, "add", (0,), dtype=lambda g, ids, rows: g,
    vjp=_scatter_vjp(lambda: _TAKE_ALONG), onnx=_scatter_along_onnx, arity=3, flops=lambda blocks, out, params: prod(blocks[0]),
    saves=_IDS))
