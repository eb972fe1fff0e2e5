"""Vectorised shard storage: all blocks of a tensor in one array ``(*grid, *chunk)``, one grid entry per
mesh atom (1 where the value is replicated), blocks padded to the ceil-rule chunk. Converts host values
to and from that layout and reads blocks; moving data between devices belongs to ``collectives``."""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from .dtypes import is_float, is_inexact
from . import backends
from .errors import ShardingError
from .mesh import MAX_DATA_DEVICES
from .layout import chunks, grid, grid_index, merge_cuts, shard_slices, spec_cuts
from .spec import ShardingSpec


def place(value: np.ndarray, spec: ShardingSpec) -> np.ndarray:
    """Lay a host value out as ``spec``; partial axes get the value at coordinate 0 and zeros elsewhere.
    Under the jax backend the blocks then go to the devices that own them."""
    check_data_mesh(spec.mesh, "shard")
    return backends.active().commit(blocks_of(np.asarray(value), spec), spec)


def check_data_mesh(mesh: Any, op: str) -> None:
    """A mesh that will hold data (every device's block on this host) has at most ``MAX_DATA_DEVICES``."""
    if mesh.size > MAX_DATA_DEVICES:
        raise ShardingError(f"{op}: mesh {mesh.name!r} has {mesh.size:,} devices; a mesh holding data has at most "
                            f"{MAX_DATA_DEVICES:,} (every device's block lives on this host). Plan at this scale "
                            f"without data: nb.abstract(shape, dtype).shard(mesh, ...)")


def blocks_of(value: np.ndarray, spec: ShardingSpec) -> np.ndarray:
    """A host value's blocks as ``spec`` stores them (grid axes in front), on the host: ``place`` without
    handing them to the backend; ``assemble`` undoes it."""
    shape = value.shape
    g = grid(spec)
    ch = chunks(spec, shape)
    x = value
    pad = [(0, prod(g.atoms[a].size for a in run) * c - n) for run, c, n in zip(g.dims, ch, shape)]
    if any(p for _, p in pad):
        x = np.pad(x, pad)
    split: list[int] = []
    dest: list[int] = []  # for each axis of `split`, its place in the stored array
    G = len(g.shape)
    for i, (run, c) in enumerate(zip(g.dims, ch)):
        split += [g.atoms[a].size for a in run] + [c]
        dest += list(run) + [G + i]
    x = x.reshape(split)
    order = sorted(range(len(dest)), key=lambda j: dest[j])
    x = x.transpose(order)
    full = [1] * (G + len(ch))
    for j, size in zip(sorted(dest), x.shape):
        full[j] = size
    x = x.reshape(full)
    if not g.partial:
        return _contiguous(x)  # kernels run fastest on contiguous blocks
    out = np.full(g.shape + ch, identity(value.dtype), dtype=value.dtype)
    first = tuple(0 if j in g.partial else slice(None) for j in range(G))
    out[first] = x[first]
    return out


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
    return _contiguous(x)


def _contiguous(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy when needed; 0-d stays 0-d (np.ascontiguousarray would make it 1-d)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


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


def identity(dtype: np.dtype) -> Any:
    """The additive identity the devices that hold no summand keep: -0.0 for floats (IEEE: x + -0.0 is x for
    every x, -0.0 included; +0.0 would turn a sum of -0.0s into +0.0), -0-0j for complex, 0 otherwise."""
    dtype = np.dtype(dtype)
    if is_float(dtype):
        return dtype.type(-0.0)
    if dtype.kind == "c":
        return dtype.type(complex(-0.0, -0.0))
    return dtype.type(0)


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


def add_once(data: np.ndarray, spec: ShardingSpec, axes: tuple[str, ...], zero: Any = None) -> np.ndarray:
    """Make a value partial over ``axes`` by keeping it on coordinate 0 and ``zero`` (by default the additive
    identity, -0.0 for floats) on the rest.

    Used when a replicated value meets a partial one in an addition: it must be added once per group,
    not once per device. Local: no data moves. (A subtrahend's other devices hold +0.0: s - +0.0 is s.)
    """
    wider = ShardingSpec(spec.mesh, spec.dim_specs, partial_axes=tuple(spec.partial_axes) + tuple(axes))
    cuts = merge_cuts(spec_cuts(spec), spec_cuts(wider))
    gw = grid(wider, cuts)
    G = len(gw.shape)
    x = data.reshape(grid(spec, cuts).shape + data.shape[len(grid(spec).shape):])
    new = [j for j in gw.partial if x.shape[j] == 1 and gw.shape[j] > 1]
    xp = backends.xp(x)
    first = np.zeros(tuple(gw.shape[j] if j in new else 1 for j in range(G)) + (1,) * (x.ndim - G), dtype=bool)
    first[(0,) * x.ndim] = True
    fill = identity(x.dtype) if zero is None else x.dtype.type(zero)
    return xp.where(first, x, xp.asarray(fill, dtype=x.dtype))
