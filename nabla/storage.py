"""Vectorised shard storage: all blocks of a tensor in one array ``(*grid, *chunk)``, one grid entry per
mesh atom (1 where the value is replicated), blocks padded to the ceil-rule chunk. Reads blocks and the
global value back; laying values out and adding once are the backends' (``backends.grid``), moving data
between devices ``collectives``'."""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from .dtypes import identity, is_inexact
from . import backends
from .backends.grid import contiguous
from .layout import chunks, grid, grid_index, shard_slices
from .spec import ShardingSpec


def assemble(data: np.ndarray, spec: ShardingSpec, shape: tuple[int, ...]) -> np.ndarray:
    """The global value of stored blocks (a host read: partial sums are added here, not communicated)."""
    data = backends.to_host(data)
    g = grid(spec)
    G = len(g.shape)
    if g.partial:
        data = sum_summands(data, tuple(g.partial))
    order: list[int] = []
    sizes: list[int] = []
    for i, run in enumerate(g.dims):
        order += list(run) + [G + i]
        sizes.append(prod(data.shape[a] for a in run) * data.shape[G + i])
    rest = [j for j in range(G) if j not in order]  # replicated atoms: size 1
    x = data.transpose(rest + order).reshape(sizes)
    if tuple(x.shape) != tuple(shape):
        x = x[tuple(slice(0, n) for n in shape)]
    return contiguous(x)


def block(data: np.ndarray, spec: ShardingSpec, shape: tuple[int, ...], device_id: int) -> np.ndarray:
    """Device ``device_id``'s block: a view into the stored array, trimmed of padding."""
    sl = shard_slices(spec, shape, device_id)
    local = data[grid_index(spec, device_id)]
    if type(local) is not np.ndarray:  # that device's own shard, copied to the host
        local = backends.to_host(local)
    return local[tuple(slice(0, s.stop - s.start) for s in sl)]


def pad_regions(spec: ShardingSpec, shape: tuple[int, ...], dim: int, cuts=None) -> tuple[tuple, ...]:
    """Index tuples (into the stored array on ``cuts``' grid) of the padding along ``dim``: for each shard
    whose block runs past the dim's end, its grid position and the tail of its chunk. At most one per shard."""
    g = grid(spec, cuts)
    run = g.dims[dim]
    c = chunks(spec, shape)[dim]
    sizes = [g.atoms[a].size for a in run]
    n = shape[dim]
    regions = []
    for p in range(prod(sizes)):
        valid = min(max(n - p * c, 0), c)
        if valid == c:
            continue
        idx: list = [slice(None)] * (len(g.shape) + len(shape))
        for a, coord in zip(run, np.unravel_index(p, sizes) if sizes else ()):
            idx[a] = int(coord)
        idx[len(g.shape) + dim] = slice(valid, None)
        regions.append(tuple(idx))
    return tuple(regions)


def fill(data, regions: tuple[tuple, ...], value):
    """A copy of ``data`` with ``value`` written into ``regions`` (padding made neutral for a reduction)."""
    return backends.of(data).fill(data, regions, value)


def sum_summands(x: Any, axes: tuple[int, ...]) -> Any:
    """The sum of partial summands held along grid ``axes``, in their dtype, starting from the additive
    identity: a sum of -0.0s is -0.0 (numpy's ``sum`` starts from +0.0)."""
    if type(x) is np.ndarray:  # what np.sum calls, without its Python wrapper
        if is_inexact(x.dtype):
            return np.add.reduce(x, axis=axes, keepdims=True, dtype=x.dtype, initial=identity(x.dtype))
        return np.add.reduce(x, axis=axes, keepdims=True, dtype=x.dtype)
    xp = backends.xp(x)
    if is_inexact(x.dtype):
        return xp.sum(x, axis=axes, keepdims=True, dtype=x.dtype, initial=identity(x.dtype))
    return xp.sum(x, axis=axes, keepdims=True, dtype=x.dtype)
