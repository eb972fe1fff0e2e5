"""The grid layout's half of the interpreter interface: every device's block in one array ``(*grid, *chunk)``, so
placing, adding once and moving are array operations on all devices at once. The numpy and the eager jax backend
share it; they differ only in the array namespace and where the blocks live (``commit``)."""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from ..dtypes import identity
from ..errors import ShardingError
from ..layout import chunks, grid, merge_cuts, spec_cuts
from ..mesh import MAX_DATA_DEVICES
from ..spec import ShardingSpec
from .base import Backend


def check_data_mesh(mesh: Any, op: str) -> None:
    """A mesh that will hold data (every device's block on this host) has at most ``MAX_DATA_DEVICES``."""
    if mesh.size > MAX_DATA_DEVICES:
        raise ShardingError(f"{op}: mesh {mesh.name!r} has {mesh.size:,} devices; a mesh holding data has at most "
                            f"{MAX_DATA_DEVICES:,} (every device's block lives on this host). Plan at this scale "
                            f"without data: nb.abstract(shape, dtype).shard(mesh, ...)")


def contiguous(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy when needed; 0-d stays 0-d (np.ascontiguousarray would make it 1-d)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def fit(x: Any, axis: int, n: int, xp: Any = np) -> Any:
    """Trim or zero-pad ``axis`` to ``n``: padding past a dim's end carries no value."""
    c = x.shape[axis]
    if c == n:
        return x
    if c > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - c)
    return xp.pad(x, pad)


def blocks_of(value: np.ndarray, spec: ShardingSpec) -> np.ndarray:
    """A host value's blocks as ``spec`` stores them (grid axes in front), on the host: ``place`` without
    handing them to the backend; ``storage.assemble`` undoes it."""
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
        return contiguous(x)  # kernels run fastest on contiguous blocks
    out = np.full(g.shape + ch, identity(value.dtype), dtype=value.dtype)
    first = tuple(0 if j in g.partial else slice(None) for j in range(G))
    out[first] = x[first]
    return out


class GridBackend(Backend):
    """The interpreter interface on the grid layout (what ``Backend`` names), for any array namespace."""

    def place(self, value: Any, spec: ShardingSpec) -> Any:
        check_data_mesh(spec.mesh, "shard")
        return self.commit(blocks_of(np.asarray(value), spec), spec)

    def add_once(self, x: Any, spec: ShardingSpec, axes: tuple[str, ...], zero: Any = None) -> Any:
        wider = ShardingSpec(spec.mesh, spec.dim_specs, partial_axes=tuple(spec.partial_axes) + tuple(axes))
        cuts = merge_cuts(spec_cuts(spec), spec_cuts(wider))
        gw = grid(wider, cuts)
        G = len(gw.shape)
        x = x.reshape(grid(spec, cuts).shape + x.shape[len(grid(spec).shape):])
        new = [j for j in gw.partial if x.shape[j] == 1 and gw.shape[j] > 1]
        first = np.zeros(tuple(gw.shape[j] if j in new else 1 for j in range(G)) + (1,) * (x.ndim - G), dtype=bool)
        first[(0,) * x.ndim] = True
        fill = identity(x.dtype) if zero is None else x.dtype.type(zero)
        xp = self.xp
        return xp.where(first, x, xp.asarray(fill, dtype=x.dtype))

    def move(self, x: Any, plan: Any, shape: tuple[int, ...] = (), reduce_op: str = "sum") -> Any:
        for seg in plan.segments:
            x = x.reshape(seg.start_grid + x.shape[seg.enter[0]:])
            for s in seg.steps:
                x = s.simulate(x, seg.enter[1], reduce_op)
            x = x.reshape(seg.end_grid + x.shape[seg.enter[1]:])
        return x

    def regrid(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x if x.shape == shape else x.reshape(shape)

    def local(self, step: Any, x: Any) -> Any:
        return step.apply(x)

    def bucket(self, entry: Any, blocks: list, plans: tuple, shapes: list) -> list:
        return entry.move(blocks, plans, shapes, self)

    def kernel(self, op: Any, arrays: list, prog: Any) -> Any:
        """(On the grid a max/min may fold its all_reduce into the kernel, ``prog.folded``: the post plan then
        only logs.)"""
        if prog.padded or prog.checks:
            # padding past a dim's end may hold anything; summands of a kept pending sum may overflow where
            # their sum does not (run() redoes the op strictly when a summand is not finite: numpy's warnings)
            with np.errstate(all="ignore"):
                out = op.kernel(arrays, prog.local)
        else:
            out = op.kernel(arrays, prog.local)
        if type(out) is not np.ndarray:
            out = self.xp.asarray(out)
        dt = out.dtype
        if dt is not prog.dtype and dt != prog.dtype:
            out = out.astype(prog.dtype)
        if out.shape != prog.out_grid:
            out = self.xp.broadcast_to(out, prog.out_grid)
        if not prog.after:  # (the common case: the kernel's output is the result as stored)
            return out
        if prog.out_grid != prog.final:
            out = out.reshape(prog.final)
        if prog.post is not None and not prog.folded:
            out = self.move(out, prog.post, prog.result_shape, op.reduction)
        return out
