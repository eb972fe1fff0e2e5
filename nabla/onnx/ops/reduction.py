"""Ops that reduce along axes: ``Reduce*`` and ``ArgMax``/``ArgMin`` (the ONNX sharding formalism's reduction
group), the softmax family (``Softmax``, ``LogSoftmax``, ``Hardmax``: a reduction along one axis, broadcast
back) and ``CumSum`` (a scan: the running reduction). They share the axis parsing of reductions and an iota
for first-index selection."""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

import nabla as nb

from ...dtypes import is_float
from ...tensor import Tensor
from .registry import OPS, Node, Op, _axis, _cast, _ints, _take, op


def _iota(n: int, axis: int, rank: int) -> np.ndarray:
    shape = [1] * rank
    shape[axis] = n
    return np.arange(n, dtype=np.int64).reshape(shape)


def _prod(x: Tensor, axes: Sequence[int], keepdims: bool) -> Tensor:
    """Product over ``axes``: a halving tree of multiplies (padding odd counts with 1)."""
    rank = x.ndim
    axes = sorted(axes)
    rest = [d for d in range(rank) if d not in axes]
    y = nb.transpose(x, rest + axes) if axes else x
    m = prod(x.shape[a] for a in axes)
    y = nb.reshape(y, tuple(x.shape[d] for d in rest) + (m,))
    last = len(rest)
    if m == 0:
        out = nb.tensor(np.ones(tuple(x.shape[d] for d in rest), dtype=x.dtype))
    else:
        while y.shape[last] > 1:
            k = y.shape[last]
            if k % 2:
                pad = nb.tensor(np.ones(y.shape[:last] + (1,), dtype=x.dtype))
                y = nb.concatenate([y, pad], last)
                k += 1
            y = _take(y, last, slice(0, k // 2)) * _take(y, last, slice(k // 2, k))
        out = nb.squeeze(y, last)
    if keepdims:
        out = nb.reshape(out, tuple(1 if d in axes else x.shape[d] for d in range(rank)))
    return out


# ---- reductions (the ONNX sharding formalism's third group) ------------------------------------------------------------


def _reduce_axes(n: Node, x: Tensor, axes_t: Tensor | None) -> tuple[int, ...]:
    """The reduced axes: () for noop_with_empty_axes with no axes (no reduction, but the composite reductions'
    elementwise steps still run: ReduceSumSquare squares, ReduceL1 takes the absolute value, as the spec says)."""
    if axes_t is not None and axes_t.size:
        axes = _ints(n.host(axes_t, "axes"))
    elif "axes" in n.attrs:
        axes = list(n.attrs["axes"])
    else:
        axes = []
    if not axes:
        if n.attr("noop_with_empty_axes", 0):
            return ()
        return tuple(range(x.ndim))
    out = sorted({_axis(n, a, x.ndim, "axes entry") for a in axes})
    if len(out) != len(axes):
        raise n.fail(f"axes {axes} repeat a dim")
    return tuple(out)


def _reduction(kernel, empty):
    """``kernel(x, axes, keepdims)``; ``empty(dtype)`` is the value of a reduction over no elements."""
    def run(n, x, axes_t=None):
        axes = _reduce_axes(n, x, axes_t)
        keep = bool(n.attr("keepdims", 1))
        if any(x.shape[a] == 0 for a in axes):
            shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape) if keep or d not in axes)
            return nb.tensor(np.full(shape, empty(x.dtype), dtype=x.dtype))
        return _cast(kernel(x, axes, keep), x.dtype)
    return run


def _lowest(dt):
    return -np.inf if is_float(dt) else np.iinfo(dt).min if dt.kind in "iu" else False


def _highest(dt):
    return np.inf if is_float(dt) else np.iinfo(dt).max if dt.kind in "iu" else True


OPS["ReduceSum"] = Op(_reduction(lambda x, a, k: nb.sum(x, a, k), lambda dt: 0))
OPS["ReduceMean"] = Op(_reduction(lambda x, a, k: nb.mean(x, a, k), lambda dt: np.nan))
OPS["ReduceMax"] = Op(_reduction(lambda x, a, k: nb.max(x, a, k), _lowest))
OPS["ReduceMin"] = Op(_reduction(lambda x, a, k: nb.min(x, a, k), _highest))
OPS["ReduceProd"] = Op(_reduction(_prod, lambda dt: 1))
OPS["ReduceL1"] = Op(_reduction(lambda x, a, k: nb.sum(nb.abs(x), a, k), lambda dt: 0))
OPS["ReduceL2"] = Op(_reduction(lambda x, a, k: nb.sqrt(nb.sum(x * x, a, k)), lambda dt: 0))
OPS["ReduceSumSquare"] = Op(_reduction(lambda x, a, k: nb.sum(x * x, a, k), lambda dt: 0))
OPS["ReduceLogSum"] = Op(_reduction(lambda x, a, k: nb.log(nb.sum(x, a, k)), lambda dt: -np.inf))
OPS["ReduceLogSumExp"] = Op(_reduction(lambda x, a, k: nb.logsumexp(x, a, k), lambda dt: -np.inf))


def _arg(which: str):
    def run(n, x):
        ax = _axis(n, n.attr("axis", 0), x.ndim)
        size = x.shape[ax]
        last = bool(n.attr("select_last_index", 0))
        if last:
            x = _take(x, ax, slice(None, None, -1))
        # (numpy's: the first NaN where there is one; a composition with min gave no index there: size, or -1)
        idx = _cast((nb.argmax if which == "max" else nb.argmin)(x, ax, bool(n.attr("keepdims", 1))), np.int64)
        return np.int64(size - 1) - idx if last else idx
    return run


OPS["ArgMax"] = Op(_arg("max"))
OPS["ArgMin"] = Op(_arg("min"))


# ---- scans ------------------------------------------------------------------------------------------


@op("CumSum")
def _cumsum(n, x, axis_t):
    ax = _axis(n, int(n.scalar(axis_t, "axis")), x.ndim)
    size = x.shape[ax]
    rev = bool(n.attr("reverse", 0))
    if rev:
        x = _take(x, ax, slice(None, None, -1))

    def shifted(y, s):  # y moved s places along ax, zeros in front
        shape = list(y.shape)
        shape[ax] = s
        return nb.concatenate([nb.tensor(np.zeros(shape, y.dtype)), _take(y, ax, slice(0, size - s))], ax)

    if n.attr("exclusive", 0) and size:
        x = shifted(x, 1)
    s = 1
    while s < size:  # Hillis-Steele scan
        x = x + shifted(x, s)
        s *= 2
    return _take(x, ax, slice(None, None, -1)) if rev else x


# ---- softmax family ---------------------------------------------------------------------------------


def _softmax_like(n: Node, x: Tensor, fn) -> Tensor:
    """Opset >= 13: along one axis. Before 13: over the flattened dims from ``axis`` on."""
    if n.opset >= 13:
        return fn(x, _axis(n, n.attr("axis", -1), x.ndim))
    ax = n.attr("axis", 1)
    ax = ax + x.ndim if ax < 0 else ax
    y = nb.reshape(x, (prod(x.shape[:ax]), prod(x.shape[ax:])))
    return nb.reshape(fn(y, 1), x.shape)


def _hardmax(x, ax):
    idx = nb.expand_dims(nb.argmax(x, ax), ax)
    return nb.astype(nb.equal(idx, _iota(x.shape[ax], ax, x.ndim)), x.dtype)


OPS["Softmax"] = Op(lambda n, x: _softmax_like(n, x, lambda y, a: nb.softmax(y, a)))
OPS["LogSoftmax"] = Op(lambda n, x: _softmax_like(n, x, lambda y, a: nb.log_softmax(y, a)))
OPS["Hardmax"] = Op(lambda n, x: _softmax_like(n, x, _hardmax))
