"""Indexing (``getitem``): basic indexing (ints, slices, None, ``...``): a sharded dim cut by a forward slice stays
sharded, each device receiving only the rows of its result block it lacks; a reversed dim is one
collective_permute. One integer array in the index is a ``take`` along its dim (``ops/gather.py``)."""

from __future__ import annotations

import builtins
import functools
from typing import Any

import numpy as np

from .. import rules as R
from ..errors import ShardingError, ShardingIndexError
from ..opdef import OpDef
from ..value import Value
from .core import ArrayLike, Tensor, apply, _is_diff, _shape
from .gather import take
from .registry import onnx_export, register
from .shape import _pad_dim, _scatter_slice, expand_dims, squeeze

INT64_MIN = -(2 ** 63)


def _index_kernel(arrays, local):
    idx, empty = _local_index(local.params[0], local.G, local.windowed)
    out = arrays[0][idx]
    if empty is not None:  # a False index: the new axis holds nothing
        out = out[empty]
    return out


@functools.lru_cache(maxsize=1024)
def _local_index(key: tuple, G: int, windowed: bool) -> tuple:
    """The index each device's block takes for a normalized ``key`` (grid axes whole), and the cut of a False
    index's empty axis (None: none); made once per key and layout, not per call."""
    idx = [slice(None)] * G
    for e in key:
        if e[0] == "full":
            idx.append(slice(None))
        elif e[0] == "reverse":  # blocks were already swapped across devices: reverse each one locally
            idx.append(slice(None, None, -1))
        elif e[0] == "slice":
            start, stop, step = e[1:]
            if windowed and step > 0:  # the window factor already cut each block to its window
                idx.append(slice(None, None, step))
            elif step < 0 and start < 0:  # slice.indices gives start -1 for "before 0": nothing is taken
                idx.append(slice(0, 0))
            else:
                idx.append(slice(start, stop if stop >= 0 else None, step))  # slice.indices gives -1 for "past 0"
        elif e[0] == "int":
            idx.append(e[1])
        else:
            idx.append(None)
    empty = None
    if any(e[0] == "empty" for e in key):
        at = [e[0] for e in key if e[0] != "int"]
        empty = (slice(None),) * G + tuple(slice(0, 0) if e == "empty" else slice(None) for e in at)
    return tuple(idx), empty


def _getitem_vjp(g, node, out):
    x, = node.args
    if not _is_diff(x):
        return (None,)
    key = node.params[0]
    shape = x._shape
    # undo new axes and integer indices first, then slices dim by dim
    squeeze_at = [i for i, e in enumerate([e for e in key if e[0] != "int"]) if e[0] == "new"]
    if squeeze_at:
        g = squeeze(g, tuple(squeeze_at))
    d = 0
    entries = [e for e in key if e[0] != "new"]
    for e in entries:
        if e[0] == "int":
            g = expand_dims(g, d)
        d += 1
    for d, e in enumerate(entries):
        n = shape[d]
        if e[0] == "reverse":
            g = g[(slice(None),) * d + (slice(None, None, -1),)]
        elif e[0] == "int":
            g = _pad_dim(g, d, e[1], n - e[1] - 1)
        elif e[0] == "slice":
            start, stop, step = e[1:]
            if step > 0:
                g = _scatter_slice(g, d, n, start, step)
            else:  # x[start:stop:step] is the reversed x cut forward from n-1-start by -step
                g = _scatter_slice(g, d, n, n - 1 - start, -step)[(slice(None),) * d + (slice(None, None, -1),)]
    return (g if g.dtype == x._dtype else g.astype(x._dtype),)


@onnx_export("Slice", "Squeeze", "Unsqueeze")
def _getitem_onnx(ex):
    """One Slice over the sliced, reversed and indexed dims, then Squeeze the indexed dims and Unsqueeze the new
    ones."""
    x = ex.operand(0)
    key = ex.params[0]
    starts, ends, axes, steps, squeezed, new = [], [], [], [], [], []
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
            squeezed.append(d)
        d += 1
        if kind != "int":
            o += 1
    stages = []
    if axes:
        stages.append(("Slice", [ex.ints(starts, "starts"), ex.ints(ends, "ends"), ex.ints(axes, "axes"),
                                 ex.ints(steps, "steps")]))
    if squeezed:
        stages.append(("Squeeze", [ex.ints(squeezed, "axes")]))
    if new:
        stages.append(("Unsqueeze", [ex.ints(new, "axes")]))
    if not stages:
        return ex.finish(ex.out("Identity", [x]), [(x, 0)])
    cur = x
    for k, (op_type, extra) in enumerate(stages):
        if k == len(stages) - 1:
            return ex.finish(ex.out(op_type, [cur] + extra), [(x, 0)])
        cur = ex.emit(op_type, [cur] + extra, op_type.lower())


def _normalize_key(key, shape: tuple[int, ...]) -> tuple[tuple, ...]:
    if not isinstance(key, tuple):
        key = (key,)
    n_real = len([k for k in key if k is not None and k is not Ellipsis and not isinstance(k, (bool, np.bool_))])
    if n_real > len(shape):
        raise ShardingIndexError(f"getitem: {n_real} indices for a tensor of rank {len(shape)}")
    if builtins.sum(k is Ellipsis for k in key) > 1:
        raise ShardingError("getitem: an index can only have a single ellipsis")
    out: list[tuple] = []
    d = 0
    for k in key:
        if k is Ellipsis:
            for _ in range(len(shape) - n_real):
                out.append(("full",))
                d += 1
        elif k is None or k is True or (isinstance(k, np.bool_) and k):
            out.append(("new",))  # numpy: a True scalar index adds an axis of size 1
        elif k is False or isinstance(k, np.bool_):
            out.append(("empty",))  # ... and False one of size 0
        elif isinstance(k, slice):
            start, stop, step = k.indices(shape[d])
            if (start, stop, step) == (0, shape[d], 1):
                out.append(("full",))
            elif step == -1 and start == shape[d] - 1 and stop == -1:
                out.append(("reverse",))
            else:
                out.append(("slice", start, stop, step))
            d += 1
        elif isinstance(k, (int, np.integer)):
            if not -shape[d] <= k < shape[d]:
                raise ShardingIndexError(f"getitem: index {k} is out of bounds for dim {d} of size {shape[d]}")
            out.append(("int", int(k) % shape[d]))
            d += 1
        else:
            raise ShardingError(f"getitem: only basic indexing (ints, slices, None, ...) is supported, got {k!r}")
    while d < len(shape):
        out.append(("full",))
        d += 1
    return tuple(out)


_KEYS: dict = {}  # (hashable form of an index, shape) -> its normalized form
_ARRAYISH = (Value, np.ndarray, list)  # what _array_entry may take for an array


def _array_entry(k: Any) -> bool:
    """Whether an index entry is an array (numpy's advanced indexing): a tensor, an array of rank >= 1 or of an
    integer dtype, or a list."""
    if isinstance(k, Value):
        return True
    if isinstance(k, np.ndarray):
        return k.ndim > 0 or k.dtype.kind != "b"
    return isinstance(k, list)


def _mask_error(k: Any) -> ShardingError:
    shape = k._shape if isinstance(k, Value) else np.shape(k)
    return ShardingError(f"getitem: a boolean mask of shape {shape} selects a number of elements that depends on "
                         f"its values, so the result has no static shape (numpy's t[mask]) and no sharding; use "
                         f"nb.where(mask, t, fill), which keeps t's shape and sharding")


def _advanced(x: ArrayLike, parts: tuple) -> Tensor:
    """One integer array among basic entries: the basic entries first, then a ``take`` along the array's dim.
    numpy puts the array's dims where the array was when it and the int entries sit next to one another in the
    index, else in front; so does this."""
    arrays = [j for j, k in enumerate(parts) if _array_entry(k)]
    if len(arrays) > 1:
        raise ShardingError(f"getitem: {len(arrays)} arrays in one index (numpy's combined advanced indexing) are "
                            f"not supported; index with one array at a time, or use nb.take_along_axis")
    j = arrays[0]
    ids = parts[j]
    if isinstance(ids, Value):
        if ids._dtype.kind == "b":
            raise _mask_error(ids)
    else:
        ids = np.asarray(ids)
        if ids.dtype.kind == "b":  # a mask on the host: its selected positions are known here
            if ids.ndim != 1:
                raise _mask_error(ids)
            rank = len(_shape(x))
            real = builtins.sum(1 for k in parts if k is not None and k is not Ellipsis)
            dim = builtins.sum(rank - real if k is Ellipsis else k is not None for k in parts[:j])
            if dim < rank and len(ids) != _shape(x)[dim]:
                raise ShardingIndexError(f"getitem: a boolean mask of length {len(ids)} for dim {dim} of size "
                                         f"{_shape(x)[dim]}")
            ids = np.flatnonzero(ids)
        elif ids.dtype.kind not in "iu" and not (ids.size == 0 and ids.dtype.kind == "f"):
            raise ShardingError(f"getitem: arrays in an index must hold integers (or be 1-D host masks), got "
                                f"dtype {ids.dtype}")
    if any(k is True or k is False or isinstance(k, np.bool_) for k in parts):
        raise ShardingError("getitem: a boolean scalar next to an array in one index is not supported")
    rank = len(_shape(x))
    real = builtins.sum(1 for k in parts if k is not None and k is not Ellipsis)
    if real > rank:
        raise ShardingIndexError(f"getitem: {real} indices for a tensor of rank {rank}")
    axis = 0
    for k in parts[:j]:  # the result dims the entries before the array leave
        if k is Ellipsis:
            axis += rank - real
        elif k is None or isinstance(k, slice):
            axis += 1
    y = getitem(x, parts[:j] + (slice(None),) + parts[j + 1:])
    out = take(y, ids, axis)
    adv = [i for i, k in enumerate(parts) if i == j or isinstance(k, (int, np.integer))]
    if adv == list(range(adv[0], adv[-1] + 1)) or axis == 0:
        return out
    ni = out.ndim - y.ndim + 1  # numpy puts the array's dims in front
    perm = tuple(range(axis, axis + ni)) + tuple(range(axis)) + tuple(range(axis + ni, out.ndim))
    return out.transpose(perm)


def getitem(x: ArrayLike, key: Any) -> Tensor:
    """Basic indexing. A sharded dim cut by a forward slice stays sharded: each device receives only the rows
    of its result block it lacks (none where they line up); a reversed dim is one collective_permute.

    One integer array (a tensor, a numpy array or a list) in the index takes those rows of its dim, as numpy's
    advanced indexing does (see ``nb.take`` for how it shards: a sharded gathered dim is looked up where its rows
    are, never gathered). A boolean mask tensor is refused: the number of elements it selects depends on its
    values; ``nb.where(mask, t, fill)`` keeps the shape (a 1-D boolean numpy array is taken as the positions it
    selects)."""
    shape = _shape(x)
    parts = key if type(key) is tuple else (key,)
    for k in parts:  # (a loop, the cheap check first)
        if isinstance(k, _ARRAYISH):
            if any(_array_entry(k) for k in parts):
                return _advanced(x, parts)
            break
    try:
        hk = (tuple([(k.start, k.stop, k.step) if type(k) is slice else (type(k), k) for k in parts]), shape)
        norm = _KEYS.get(hk)
    except TypeError:  # an unhashable index: refused by _normalize_key with its message
        hk, norm = None, None
    if norm is None:
        norm = _normalize_key(key, shape)
        if hk is not None and len(_KEYS) < 4096:
            _KEYS[hk] = norm
    return apply(_INDEX, (x,), (norm,))


_INDEX = register(OpDef("getitem", lambda shapes, key: R.index_rule(shapes[0], key), _index_kernel, "add",
                        dtype="same", vjp=_getitem_vjp, onnx=_getitem_onnx, arity=1, public=getitem,
                        saves="none"))


for _moving in (_INDEX,):  # data moves, nothing is computed: no FLOPs
    _moving.flops = lambda blocks, out, params: 0
