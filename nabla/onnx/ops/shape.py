"""Shape and data movement: ``Shape``, ``Size``, ``Reshape``, ``Flatten``, ``Transpose``, ``Concat``, ``Split``,
``Slice``, ``Unsqueeze``, ``Squeeze``, ``Expand``, ``Tile`` and ``Pad``. Each moves or rearranges elements
without arithmetic; the values that decide their shapes (targets, bounds, pads) are read on the host."""

from __future__ import annotations

import builtins
from math import prod

import numpy as np

import nabla as nb

from ...tensor import Tensor
from .registry import Node, _axis, _ints, _take, op


@op("Shape")
def _shape(n, x):
    dims = list(x.shape)
    start, end = n.attr("start", 0), n.attr("end", None)
    return nb.tensor(np.array(dims[start:end] if end is not None else dims[start:], dtype=np.int64))


@op("Size")
def _size(n, x):
    return nb.tensor(np.array(x.size, dtype=np.int64))


@op("Reshape")
def _reshape(n, x, shape_t=None):
    target = _ints(n.host(shape_t, "shape")) if shape_t is not None else list(n.attr("shape"))
    if not n.attr("allowzero", 0):
        target = [x.shape[i] if v == 0 else v for i, v in enumerate(target)]
    return nb.reshape(x, tuple(target))


@op("Flatten")
def _flatten(n, x):
    ax = n.attr("axis", 1)
    if not -x.ndim <= ax <= x.ndim:
        raise n.fail(f"axis {ax} is out of range for rank {x.ndim}")
    if ax < 0:
        ax += x.ndim
    return nb.reshape(x, (prod(x.shape[:ax]), prod(x.shape[ax:])))


@op("Transpose")
def _transpose(n, x):
    perm = n.attr("perm", None)
    return nb.transpose(x, None if perm is None else tuple(perm))


@op("Concat")
def _concat(n, *xs):
    ax = _axis(n, n.attr("axis"), xs[0].ndim)
    return nb.concatenate(list(xs), ax)


@op("Split")
def _split(n, x, split_t=None):
    ax = _axis(n, n.attr("axis", 0), x.ndim)
    size = x.shape[ax]
    outs = len(n.proto.output)
    if split_t is not None and split_t.size:
        sizes = _ints(n.host(split_t, "split"))
    elif n.attrs.get("split"):
        sizes = list(n.attrs["split"])
    else:
        k = n.attr("num_outputs", None) or outs
        if n.opset >= 18 and n.attr("num_outputs", None):
            c = -(-size // k)
            sizes = [c] * (size // c) + ([size % c] if size % c else [])
        else:
            if size % k:
                raise n.fail(f"dim {ax} of size {size} does not split evenly into {k} outputs")
            sizes = [size // k] * k
    if builtins.sum(sizes) != size or len(sizes) != outs:
        raise n.fail(f"split sizes {sizes} do not cover dim {ax} of size {size} in {outs} outputs")
    out, at = [], 0
    for s in sizes:
        out.append(_take(x, ax, slice(at, at + s)))
        at += s
    return tuple(out)


def _slice_bounds(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX's clamping (negative values count from the end), as a Python slice numpy agrees with."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return slice(start, end, step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@op("Slice")
def _slice(n, x, starts=None, ends=None, axes=None, steps=None):
    if n.opset < 10:
        st, en = list(n.attr("starts")), list(n.attr("ends"))
        ax = list(n.attr("axes", list(range(len(st)))))
        sp = [1] * len(st)
    else:
        st, en = _ints(n.host(starts, "starts")), _ints(n.host(ends, "ends"))
        ax = _ints(n.host(axes, "axes")) if axes is not None else list(range(len(st)))
        sp = _ints(n.host(steps, "steps")) if steps is not None else [1] * len(st)
    key = [slice(None)] * x.ndim
    for s, e, a, p in zip(st, en, ax, sp):
        if p == 0:
            raise n.fail("a slice step cannot be 0")
        a = _axis(n, a, x.ndim, "axes entry")
        key[a] = _slice_bounds(s, e, p, x.shape[a])
    return x[tuple(key)]


@op("Unsqueeze")
def _unsqueeze(n, x, axes_t=None):
    axes = _ints(n.host(axes_t, "axes")) if axes_t is not None else list(n.attr("axes"))
    r = x.ndim + len(axes)
    norm = sorted(_axis(n, a, r, "axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        raise n.fail(f"axes {axes} repeat a dim")
    return nb.expand_dims(x, tuple(norm))


@op("Squeeze")
def _squeeze(n, x, axes_t=None):
    if axes_t is not None:
        axes = _ints(n.host(axes_t, "axes"))
    else:
        axes = n.attr("axes", None)
    if axes is None or len(axes) == 0:
        return nb.squeeze(x)
    return nb.squeeze(x, tuple(_axis(n, a, x.ndim, "axes entry") for a in axes))


@op("Expand")
def _expand(n, x, shape_t):
    target = tuple(_ints(n.host(shape_t, "shape")))
    try:
        out = np.broadcast_shapes(x.shape, target)
    except ValueError:
        raise n.fail(f"shape {x.shape} does not broadcast with {target}") from None
    return x if out == x.shape else nb.broadcast_to(x, out)


@op("Tile")
def _tile(n, x, reps_t):
    reps = _ints(n.host(reps_t, "repeats"))
    if len(reps) != x.ndim:
        raise n.fail(f"repeats {reps} must have one entry per dim of a rank-{x.ndim} tensor")
    for ax, r in enumerate(reps):
        if r == 0:
            x = _take(x, ax, slice(0, 0))
        elif r > 1:
            x = nb.concatenate([x] * r, ax)
    return x


def _padding(n: Node, x: Tensor, pads_t, axes_t) -> list[tuple[int, int]]:
    if n.opset < 11:
        pads = list(n.attr("pads", n.attr("paddings", [])))
    else:
        pads = _ints(n.host(pads_t, "pads"))
    axes = list(range(x.ndim)) if axes_t is None else [_axis(n, a, x.ndim, "axes entry")
                                                       for a in _ints(n.host(axes_t, "axes"))]
    if len(pads) != 2 * len(axes):
        raise n.fail(f"pads {pads} must have two entries per padded axis ({len(axes)} axes)")
    out = [(0, 0)] * x.ndim
    for i, a in enumerate(axes):
        out[a] = (pads[i], pads[i + len(axes)])
    return out


@op("Pad")
def _pad(n, x, pads_t=None, value_t=None, axes_t=None):
    mode = n.attr("mode", "constant")
    pads = _padding(n, x, pads_t, axes_t)
    if n.opset < 11:
        value = n.attr("value", 0.0)
    else:
        value = 0 if value_t is None or value_t.size == 0 else n.scalar(value_t, "constant_value")
    for ax, (lo, hi) in enumerate(pads):  # crop first (negative pads)
        if lo < 0 or hi < 0:
            x = _take(x, ax, slice(-min(lo, 0), x.shape[ax] + min(hi, 0)))
    for ax, (lo, hi) in enumerate(pads):
        lo, hi = max(lo, 0), max(hi, 0)
        if not lo and not hi:
            continue
        size = x.shape[ax]
        if mode == "constant":
            def block(k):
                shape = list(x.shape)
                shape[ax] = k
                return nb.tensor(np.full(shape, value, dtype=x.dtype))
            parts = [block(lo)] * bool(lo) + [x] + [block(hi)] * bool(hi)
        elif mode == "edge":
            if size == 0:
                raise n.fail(f"edge padding of an empty dim {ax}")
            parts = [_take(x, ax, slice(0, 1))] * lo + [x] + [_take(x, ax, slice(size - 1, size))] * hi
        elif mode == "reflect":
            if lo >= size or hi >= size:
                raise n.fail(f"reflect padding ({lo}, {hi}) needs dim {ax} larger than the pads, it has {size}")
            parts = [_take(x, ax, slice(lo, 0, -1))] * bool(lo) + [x] + \
                [_take(x, ax, slice(size - 2, size - 2 - hi, -1) if size - 2 - hi >= 0
                       else slice(size - 2, None, -1))] * bool(hi)
        elif mode == "wrap":
            if size == 0:
                raise n.fail(f"wrap padding of an empty dim {ax}")
            parts = [_take(x, ax, slice(size - lo % size, size))] * bool(lo % size) + [x] * (lo // size) + [x] \
                + [x] * (hi // size) + [_take(x, ax, slice(0, hi % size))] * bool(hi % size)
        else:
            raise n.fail(f"unknown pad mode {mode!r}")
        x = nb.concatenate(parts, ax)
    return x
