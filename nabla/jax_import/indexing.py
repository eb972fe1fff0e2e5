"""``gather`` and ``scatter-add`` read through their dimension numbers: a lookup of whole slices at points of the
indexed dims is nabla's ``take`` (several indexed dims: flattened into one), one with batching dims is
``take_along_axis``; their transposes are nabla's ``scatter_add`` and ``scatter_add_along``. Indices out of range
follow the equation's mode (clamped, or filled/dropped) exactly; they are checked on the host when they hold data."""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

from .. import ops as O
from ..errors import ShardingError
from ..ops.gather import scatter_add, scatter_add_along
from ..ops import lax_ops as X
from ..tensor import Tensor
from .table import as_tensor, primitive

_CLIP, _FILL = 0, 1  # GatherScatterMode.CLIP, FILL_OR_DROP (PROMISE_IN_BOUNDS: 2 is trusted)


def _mode(e) -> int:
    m = e.params.get("mode")
    name = getattr(m, "name", str(m))
    return _CLIP if name == "CLIP" else _FILL if name == "FILL_OR_DROP" else 2


def _columns(ids: Tensor, k: int) -> list[Tensor]:
    """The index vector's ``k`` entries, each a tensor of the indices' batch shape."""
    return [ids[..., j] for j in range(k)]


def _in_range(cols: Sequence[Tensor], limits: Sequence[int]) -> Tensor | None:
    """Where every start lies in ``[0, limit]``; None when all do (checked on the host) or nothing can tell."""
    bad = False
    for c, hi in zip(cols, limits):
        if not isinstance(c, Tensor) or c.is_abstract:
            continue
        v = c.numpy()
        if v.size and (v.min() < 0 or v.max() > hi):
            bad = True
    if not bad:
        return None
    ok = None
    for c, hi in zip(cols, limits):
        here = X.bitwise_and(O.greater_equal(c, 0), O.less_equal(c, hi))
        ok = here if ok is None else X.bitwise_and(ok, here)
    return ok


def _clipped(cols: Sequence[Tensor], limits: Sequence[int]) -> list[Tensor]:
    return [O.minimum(O.maximum(c, 0), hi) for c, hi in zip(cols, limits)]


def _linear(cols: Sequence[Tensor], sizes: Sequence[int]) -> Tensor:
    """Row-major linear index of several indexed dims of sizes ``sizes``."""
    out = cols[0]
    for c, n in zip(cols[1:], sizes[1:]):
        out = out * n + c
    return out


@primitive("gather")
def _gather(ev, e, x, ids):
    x, ids = as_tensor(x), as_tensor(ids)
    dn = e.params["dimension_numbers"]
    sizes = tuple(int(s) for s in e.params["slice_sizes"])
    offset, collapsed = tuple(dn.offset_dims), set(dn.collapsed_slice_dims)
    smap = tuple(dn.start_index_map)
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
    k = len(smap)
    for d in smap:
        if sizes[d] != 1:
            raise ShardingError(f"a gather of windows of {sizes[d]} elements along indexed dim {d} (a dynamic "
                                f"slice) is not supported; only whole slices at points of the indexed dims")
    window = tuple(slice(0, s) if d not in smap and d not in obatch else slice(None) for d, s in enumerate(sizes))
    if any(s.stop is not None and s.stop != n for s, n in zip(window, x.shape)):
        x = x[window]  # dims not indexed start at 0: a static window
    cols = _columns(ids, k)
    limits = [x.shape[d] - 1 for d in smap]
    mode = _mode(e)
    valid = None
    if mode == _CLIP:
        cols = _clipped(cols, limits)
    elif mode == _FILL:
        valid = _in_range(cols, limits)
        if valid is not None:
            cols = _clipped(cols, limits)
    nb_ = ids.ndim - 1  # the indices' batch dims
    if obatch:
        t, labels = _gather_batched(x, cols, smap, obatch, ibatch, nb_)
    else:
        t, labels = _gather_points(x, cols, smap)
    # the result: offset dims (operand dims neither collapsed nor batching, in order) at ``offset``, batch dims
    # of the indices elsewhere, in order
    kept = [d for d in range(x.ndim) if d not in collapsed and d not in obatch]
    missing = [f"o{d}" for d in kept if f"o{d}" not in labels]  # indexed but not collapsed: a size-1 dim
    if missing:
        t = O.expand_dims(t, tuple(range(t.ndim, t.ndim + len(missing))))
        labels = labels + missing
    rank = nb_ + len(kept)
    want, b = [None] * rank, iter(range(nb_))
    for pos, d in zip(offset, kept):
        want[pos] = f"o{d}"
    want = [w if w is not None else f"b{next(b)}" for w in want]
    perm = tuple(labels.index(w) for w in want)
    if perm != tuple(range(len(perm))):
        t = O.transpose(t, perm)
    if valid is not None:
        fill = e.params.get("fill_value")
        if fill is None:
            fill = np.nan if np.dtype(t.dtype).kind in "fcV" else 0
        v = O.expand_dims(valid, tuple(offset)) if offset else valid
        t = O.where(v, t, np.asarray(fill, dtype=t.dtype)[()])
    return t


def _gather_points(x: Tensor, cols: list[Tensor], smap: tuple[int, ...]) -> tuple[Tensor, list[str]]:
    """Whole slices at points of the indexed dims: ``take`` along one dim, or along the indexed dims flattened."""
    nbatch = cols[0].ndim
    bl = [f"b{j}" for j in range(nbatch)]
    if len(smap) == 1:
        a = smap[0]
        t = O.take(x, cols[0], axis=a)
        return t, [f"o{d}" for d in range(a)] + bl + [f"o{d}" for d in range(a + 1, x.ndim)]
    rest = [d for d in range(x.ndim) if d not in smap]
    y = O.transpose(x, tuple(smap) + tuple(rest))
    y = O.reshape(y, (prod(x.shape[d] for d in smap),) + tuple(x.shape[d] for d in rest))
    t = O.take(y, _linear(cols, [x.shape[d] for d in smap]), axis=0)
    return t, bl + [f"o{d}" for d in rest]


def _batched_layout(x_shape, cols, smap, obatch, ibatch, nb_):
    """How indices with batching dims line up with the operand: for each operand dim, the index dims it reads."""
    if len(smap) != 1:
        raise ShardingError("a gather/scatter with batching dims and several indexed dims is not supported")
    a = smap[0]
    pair = dict(zip(obatch, ibatch))
    free = [j for j in range(nb_) if j not in ibatch]
    order, shape = [], []
    for d in range(len(x_shape)):
        if d in pair:
            order.append(pair[d])
            shape.append(cols[0].shape[pair[d]])
        elif d == a:
            order.extend(free)
            shape.append(prod(cols[0].shape[j] for j in free))
        else:
            shape.append(1)
    return a, pair, free, tuple(order), tuple(shape)


def _gather_batched(x, cols, smap, obatch, ibatch, nb_):
    """``take_along_axis``: the indices laid out as the operand (batching dims paired, the free index dims
    flattened along the indexed dim, size 1 on the dims taken whole)."""
    a, pair, free, order, shape = _batched_layout(x.shape, cols, smap, obatch, ibatch, nb_)
    idx = cols[0]
    if order != tuple(range(len(order))):
        idx = O.transpose(idx, order)
    idx = O.reshape(idx, shape)
    t = O.take_along_axis(x, idx, axis=a)
    out_shape, labels = [], []
    for d in range(x.ndim):
        if d in pair:
            out_shape.append(t.shape[d])
            labels.append(f"b{pair[d]}")
        elif d == a:
            out_shape.extend(cols[0].shape[j] for j in free)
            labels.extend(f"b{j}" for j in free)
        else:
            out_shape.append(t.shape[d])
            labels.append(f"o{d}")
    if tuple(out_shape) != t.shape:
        t = O.reshape(t, tuple(out_shape))
    return t, labels


@primitive("scatter-add", "scatter_add")
def _scatter_add(ev, e, base, ids, upd):
    base, ids, upd = as_tensor(base), as_tensor(ids), as_tensor(upd)
    dn = e.params["dimension_numbers"]
    uwin, inserted = tuple(dn.update_window_dims), set(dn.inserted_window_dims)
    smap = tuple(dn.scatter_dims_to_operand_dims)
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
    k = len(smap)
    nb_ = ids.ndim - 1
    window_dims = [d for d in range(base.ndim) if d not in inserted and d not in obatch]
    # update labels: scatter dims (the indices' batch dims, in order) where uwin is not, window dims at uwin
    ul, b = [None] * upd.ndim, iter(range(nb_))
    for pos, d in zip(uwin, window_dims):
        ul[pos] = f"o{d}"
    ul = [u if u is not None else f"b{next(b)}" for u in ul]
    for d in smap:
        if d not in inserted:
            raise ShardingError(f"a scatter of windows along indexed dim {d} is not supported")
    wsize = {d: upd.shape[ul.index(f"o{d}")] for d in window_dims}
    cols = _columns(ids, k)
    limits = [base.shape[d] - 1 for d in smap]
    mode = _mode(e)
    if mode == _CLIP:
        cols = _clipped(cols, limits)
    elif mode == _FILL:
        valid = _in_range(cols, limits)
        if valid is not None:  # out-of-range updates are dropped
            cols = _clipped(cols, limits)
            v = valid
            wpos = [ul.index(f"o{d}") for d in window_dims]
            v = O.expand_dims(v, tuple(sorted(wpos))) if wpos else v
            upd = O.where(v, upd, np.asarray(0, dtype=upd.dtype)[()])
    # the region the updates can reach: dims not indexed start at 0 (a static window of the operand)
    region = tuple(wsize.get(d, n) if d in wsize else n for d, n in enumerate(base.shape))
    if obatch:
        out = _scatter_batched(base.shape, region, cols, upd, ul, smap, obatch, ibatch, nb_, base)
    else:
        out = _scatter_points(base.shape, region, cols, upd, ul, smap, base)
    if region != base.shape:
        out = O.pad(out, [(0, n - r) for n, r in zip(base.shape, region)])
    return base + out


def _scatter_points(shape, region, cols, upd, ul, smap, base):
    """The transpose of ``take``: ``scatter_add`` along the indexed dim (several: flattened into one)."""
    if len(smap) == 1:
        a = smap[0]
        want = [f"o{d}" for d in range(a)] + [f"b{j}" for j in range(cols[0].ndim)] + \
               [f"o{d}" for d in range(a + 1, len(shape))]
        upd = _arranged(upd, ul, want)
        return scatter_add(upd, cols[0], shape[a], a, like=base if region == shape else None)
    rest = [d for d in range(len(shape)) if d not in smap]
    want = [f"b{j}" for j in range(cols[0].ndim)] + [f"o{d}" for d in rest]
    upd = _arranged(upd, ul, want)
    flat = scatter_add(upd, _linear(cols, [shape[d] for d in smap]), prod(shape[d] for d in smap), 0)
    flat = O.reshape(flat, tuple(shape[d] for d in smap) + tuple(region[d] for d in rest))
    back = [0] * len(shape)  # flat's dims are smap then rest; put each operand dim back in place
    for i, d in enumerate(list(smap) + rest):
        back[d] = i
    return O.transpose(flat, tuple(back))


def _scatter_batched(shape, region, cols, upd, ul, smap, obatch, ibatch, nb_, base):
    """The transpose of ``take_along_axis``: ``scatter_add_along`` with indices and updates laid out as the
    operand (free index dims flattened along the indexed dim)."""
    a, pair, free, order, ishape = _batched_layout(shape, cols, smap, obatch, ibatch, nb_)
    want, ushape = [], []
    for d in range(len(shape)):
        if d in pair:
            want.append(f"b{pair[d]}")
        elif d == a:
            want.extend(f"b{j}" for j in free)
        else:
            want.append(f"o{d}")
    upd = _arranged(upd, ul, want)
    for d in range(len(shape)):
        ushape.append(ishape[d] if d in pair or d == a else region[d])
    upd = O.reshape(upd, tuple(ushape)) if tuple(ushape) != upd.shape else upd
    idx = cols[0]
    if order != tuple(range(len(order))):
        idx = O.transpose(idx, order)
    idx = O.reshape(idx, ishape)
    if idx.shape != upd.shape:
        idx = O.broadcast_to(idx, upd.shape)
    return scatter_add_along(upd, idx, shape[a], a)


def _arranged(t: Tensor, labels: list[str], want: list[str]) -> Tensor:
    perm = tuple(labels.index(w) for w in want)
    return t if perm == tuple(range(len(perm))) else O.transpose(t, perm)
