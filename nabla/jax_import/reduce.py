"""Reductions and contractions: ``reduce_*``, ``argmax``/``argmin``, ``cumsum``, ``sort`` (several operands sorted
by their keys), ``top_k``, and ``dot_general`` (any dimension numbers, as one einsum)."""

from __future__ import annotations

import string

import numpy as np

from .. import ops as O
from ..errors import ShardingError
from .table import as_tensor, primitive


def _axes(e) -> tuple[int, ...]:
    return tuple(int(a) for a in e.params["axes"])


def _reduction(fn):
    def run(ev, e, x):
        axes = _axes(e)
        return fn(as_tensor(x), axis=axes) if axes else x
    return run


for _name, _fn in {"reduce_sum": O.sum, "reduce_max": O.max, "reduce_min": O.min, "reduce_prod": O.prod,
                   "reduce_and": O.all, "reduce_or": O.any}.items():
    primitive(_name)(_reduction(_fn))


def _search(fn):
    def run(ev, e, x):
        axes = _axes(e)
        if len(axes) != 1:
            raise ShardingError(f"over {len(axes)} axes; one is supported")
        return O.astype(fn(as_tensor(x), axis=axes[0]), e.params["index_dtype"])
    return run


primitive("argmax")(_search(O.argmax))
primitive("argmin")(_search(O.argmin))


@primitive("cumsum")
def _cumsum(ev, e, x):
    axis = int(e.params["axis"])
    x = as_tensor(x)
    if e.params.get("reverse"):
        return O.flip(O.cumsum(O.flip(x, axis), axis=axis), axis)
    return O.cumsum(x, axis=axis)


@primitive("sort")
def _sort(ev, e, *xs):
    """Every operand put in the order that sorts the first ``num_keys`` of them (lexicographically, stable)."""
    axis = int(e.params["dimension"])
    k = int(e.params.get("num_keys", 1))
    xs = [as_tensor(x) for x in xs]
    if len(xs) == 1:
        return [O.sort(xs[0], axis=axis)]
    perm = O.argsort(xs[k - 1], axis=axis)
    for key in reversed(xs[:k - 1]):  # stable sorts from the last key to the first: lexicographic order
        perm = O.take_along_axis(perm, O.argsort(O.take_along_axis(key, perm, axis=axis), axis=axis), axis=axis)
    return [O.take_along_axis(x, perm, axis=axis) for x in xs]


@primitive("top_k")
def _top_k(ev, e, x, *dyn):
    k = int(e.params["k"])
    axis = int(e.params.get("axis", -1) or -1) if "axis" in e.params else -1
    x = as_tensor(x)
    if axis not in (-1, x.ndim - 1):
        raise ShardingError("top_k along a dim other than the last is not supported")
    values, indices = O.top_k(x, k)
    return [values, indices]


@primitive("dot_general")
def _dot_general(ev, e, lhs, rhs):
    """One einsum: batch dims first, then lhs's free dims, then rhs's (dot_general's result order)."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lhs, rhs = as_tensor(lhs), as_tensor(rhs)
    want = e.params.get("preferred_element_type")
    common = np.dtype(want) if want is not None else np.result_type(lhs.dtype, rhs.dtype)
    if lhs.dtype != common:
        lhs = O.astype(lhs, common)
    if rhs.dtype != common:
        rhs = O.astype(rhs, common)
    letters = iter(string.ascii_letters)
    lt, rt = [None] * lhs.ndim, [None] * rhs.ndim
    batch = []
    for a, b in zip(lb, rb):
        c = next(letters)
        lt[a] = rt[b] = c
        batch.append(c)
    for a, b in zip(lc, rc):
        lt[a] = rt[b] = next(letters)
    lfree = [lt.__setitem__(d, next(letters)) or lt[d] for d in range(lhs.ndim) if lt[d] is None]
    rfree = [rt.__setitem__(d, next(letters)) or rt[d] for d in range(rhs.ndim) if rt[d] is None]
    spec = f"{''.join(lt)},{''.join(rt)}->{''.join(batch + lfree + rfree)}"
    return O.einsum(spec, lhs, rhs)


def _cumulative(combine, identity):
    """A scan by an associative ``combine`` along one dim in log2(n) steps (Hillis and Steele): each step combines
    every element with the one ``shift`` before it (``identity`` past the start), doubling ``shift``."""
    def run(ev, e, x):
        axis = int(e.params["axis"])
        x = as_tensor(x)
        if e.params.get("reverse"):
            x = O.flip(x, axis)
        n, shift = x.shape[axis], 1
        fill = identity(x.dtype)
        while shift < n:
            widths = [(0, 0)] * x.ndim
            widths[axis] = (shift, 0)
            before = O.pad(x[(slice(None),) * axis + (slice(0, n - shift),)], widths, constant_values=fill)
            x = combine(x, before)
            shift *= 2
        return O.flip(x, axis) if e.params.get("reverse") else x
    return run


def _lowest(dt):
    dt = np.dtype(dt)
    return -np.inf if dt.kind == "f" else np.iinfo(dt).min if dt.kind in "iu" else False


def _highest(dt):
    dt = np.dtype(dt)
    return np.inf if dt.kind == "f" else np.iinfo(dt).max if dt.kind in "iu" else True


def _logaddexp(a, b):
    top = O.maximum(a, b)
    safe = O.where(O.isfinite(top), top, 0.0)
    return safe + O.log(O.exp(a - safe) + O.exp(b - safe))


primitive("cummax")(_cumulative(O.maximum, _lowest))
primitive("cummin")(_cumulative(O.minimum, _highest))
primitive("cumprod")(_cumulative(O.multiply, lambda dt: 1))
primitive("cumlogsumexp")(_cumulative(_logaddexp, lambda dt: -np.inf))
