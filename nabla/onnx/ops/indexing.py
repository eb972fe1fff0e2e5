"""Ops that select elements by index: ``Gather``, ``GatherElements``, ``OneHot`` (indices held in a tensor, which
stays on the mesh) and ``Trilu`` (entries kept by their row and column)."""

from __future__ import annotations

import numpy as np

import nabla as nb

from .registry import _axis, _c, _cast, op


@op("Gather")
def _gather(n, x, idx):
    """nb.take: the indices stay on the mesh (the result keeps their sharding), a gathered dim sharded on the
    mesh is looked up where its rows are (partial sums, summed when needed): every move is in the comm log."""
    return nb.take(x, idx, _axis(n, n.attr("axis", 0), x.ndim))


@op("GatherElements")
def _gather_elements(n, x, idx):
    """nb.take_along_axis; ONNX lets the indices be shorter than the data on the other dims (their prefix)."""
    ax = _axis(n, n.attr("axis", 0), x.ndim)
    if idx.ndim != x.ndim:
        raise n.fail(f"indices of rank {idx.ndim} for data of rank {x.ndim}")
    key = tuple(slice(None) if d == ax or m == k else slice(0, k) for d, (m, k) in enumerate(zip(x.shape, idx.shape)))
    if any(k > m for d, (m, k) in enumerate(zip(x.shape, idx.shape)) if d != ax):
        raise n.fail(f"indices of shape {idx.shape} are longer than the data {x.shape} on a dim other than {ax}")
    return nb.take_along_axis(x[key] if any(s != slice(None) for s in key) else x, idx, ax)


@op("OneHot")
def _one_hot(n, idx, depth_t, values):
    """nb.one_hot on the indices (negative ones counted from the end, as ONNX does), then on/off values."""
    depth = int(np.asarray(n.scalar(depth_t, "depth")).astype(np.int64))
    rank = idx.ndim + 1
    ax = _axis(n, n.attr("axis", -1), rank)
    if values.shape != (2,):
        raise n.fail(f"values must hold [off, on], got shape {values.shape}")
    ids = _cast(idx, np.int64)
    ids = nb.where(ids < 0, ids + np.int64(depth), ids)
    hot = nb.one_hot(ids, depth, dtype="bool", axis=ax)
    return nb.where(hot, values[1], values[0])


@op("Trilu")
def _trilu(n, x, k_t=None):
    k = 0 if k_t is None else int(n.scalar(k_t, "k"))
    rows, cols = x.shape[-2], x.shape[-1]
    i = np.arange(rows).reshape(rows, 1)
    j = np.arange(cols).reshape(1, cols)
    mask = (j - i >= k) if n.attr("upper", 1) else (j - i <= k)
    return nb.where(mask, x, _c(x, 0))
