"""Where each block lives: the ceil rule (a dim of ``n`` over ``k`` shards gives each ``ceil(n / k)``,
5 over 4: 2, 2, 1, 0), per-device slices, and the device grid of mesh atoms. Pure and cached on
(spec, shape); blocks are stored padded to the ceil chunk (see ``storage``)."""

from __future__ import annotations

from functools import lru_cache
from math import prod
from typing import NamedTuple, Sequence

import numpy as np

from .errors import ShardingError
from .mesh import AxisRef, DeviceMesh
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # layouts read specs; specs build on layouts (spec.shard_slices), so no import at run time
    from .spec import ShardingSpec


def ceil_div(n: int, k: int) -> int:
    return -(-n // k)


def chunk(n: int, k: int) -> int:
    """Elements per shard under the ceil rule."""
    return ceil_div(n, k) if k > 1 else n


def is_nested(n: int, k: int, s: int) -> bool:
    """Whether splitting each of ``k`` ceil-rule shards of ``n`` into ``s`` gives the ceil rule for ``k*s``.

    Only then is adding (or removing) a minor axis on a dim a purely local slice (or a plain gather).
    """
    return chunk(n, k) == s * chunk(n, k * s)


@lru_cache(maxsize=8192)
def chunks(spec: ShardingSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The padded local block shape of ``spec`` on a tensor of global ``shape``."""
    spec.check_rank(shape)
    return tuple(chunk(n, spec.num_shards(i)) for i, n in enumerate(shape))


def dim_position(refs: Sequence[AxisRef], mesh: DeviceMesh, coords: Sequence[int]) -> int:
    """The index of a device's shard along a dim sharded by ``refs`` (major to minor)."""
    pos = 0
    for r in refs:
        pos = pos * r.size + r.coord(coords[mesh.axis_index(r.name)])
    return pos


@lru_cache(maxsize=8192)
def shard_slices(spec: ShardingSpec, shape: tuple[int, ...], device_id: int) -> tuple[slice, ...]:
    coords = spec.mesh.coords(device_id)
    out = []
    for refs, n, c in zip(spec.dim_refs, shape, chunks(spec, shape)):
        start = min(n, dim_position(refs, spec.mesh, coords) * c)
        out.append(slice(start, min(n, start + c)))
    return tuple(out)


# ---- the device grid: mesh axes cut into atoms -----------------------------------------------------


class Grid(NamedTuple):
    """A refinement of the mesh into atoms (sub-axes), in mesh order, major to minor within an axis.

    ``shape`` has one entry per atom: its size where the spec uses it, 1 where the value is the same
    on all its devices (a replica, stored once). ``dims`` and ``partial`` give atom indices.
    """

    atoms: tuple[AxisRef, ...]
    shape: tuple[int, ...]
    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...]


def spec_cuts(spec: ShardingSpec) -> tuple[frozenset[int], ...]:
    """Per mesh axis, the points where the spec's sub-axes start or end."""
    cuts = [set() for _ in spec.mesh.shape]
    for refs in spec.dim_refs + (spec.partial_refs,):
        for r in refs:
            i = spec.mesh.axis_index(r.name)
            cuts[i].update((r.pre, r.pre * r.size))
    return tuple(frozenset(c) for c in cuts)


def merge_cuts(*all_cuts: tuple[frozenset[int], ...]) -> tuple[frozenset[int], ...] | None:
    """The common refinement of several specs' cuts, or None when they do not nest."""
    merged = tuple(frozenset().union(*c) for c in zip(*all_cuts))
    for c in merged:
        pts = sorted(c)
        if any(b % a for a, b in zip(pts, pts[1:])):
            return None
    return merged


@lru_cache(maxsize=8192)
def grid(spec: ShardingSpec, cuts: tuple[frozenset[int], ...] | None = None) -> Grid:
    """The atom grid of ``spec`` (at its own cuts, or a finer common refinement)."""
    mesh = spec.mesh
    cuts = spec_cuts(spec) if cuts is None else cuts
    atoms: list[AxisRef] = []
    for name, n, c in zip(mesh.axis_names, mesh.shape, cuts):
        pts = sorted(c | {1, n})
        atoms += [AxisRef(name, a, b // a, n) for a, b in zip(pts, pts[1:])]

    def runs(refs: Sequence[AxisRef]) -> tuple[int, ...]:
        idx: list[int] = []
        for r in refs:
            run = [j for j, a in enumerate(atoms) if a.name == r.name and r.pre <= a.pre
                   and a.pre * a.size <= r.pre * r.size]
            if prod(atoms[j].size for j in run) != r.size:
                raise ShardingError(f"internal: cuts {cuts} do not refine axis {r}")
            idx += run
        return tuple(idx)

    dims = tuple(runs(refs) for refs in spec.dim_refs)
    partial = runs(spec.partial_refs)
    used = set(partial).union(*dims) if dims else set(partial)
    shape = tuple(a.size if j in used else 1 for j, a in enumerate(atoms))
    return Grid(tuple(atoms), shape, dims, partial)


@lru_cache(maxsize=8192)
def grid_index(spec: ShardingSpec, device_id: int) -> tuple[int, ...]:
    """Where a device's block sits in the stored grid (0 on atoms the value is replicated over)."""
    g = grid(spec)
    coords = spec.mesh.coords(device_id)
    return tuple(a.coord(coords[spec.mesh.axis_index(a.name)]) if s > 1 else 0
                 for a, s in zip(g.atoms, g.shape))




def global_rows(spec: ShardingSpec, cuts, n: int, dim: int, rank: int) -> np.ndarray:
    """For stored blocks of ``spec`` on the grid ``cuts``, the global index along ``dim`` (of size ``n``) of
    every local row: shape ``(*grid, 1.., chunk, 1..)`` with size-1 grid axes where the dim is not sharded."""
    g = grid(spec, cuts)
    c = chunk(n, spec.num_shards(dim))
    run = [a for a in g.dims[dim] if g.shape[a] > 1]
    sizes = [g.shape[a] for a in run]
    k = prod(sizes)
    rows = (np.arange(k)[:, None] * c + np.arange(c)).reshape(tuple(sizes) + (c,))
    shape = [1] * (len(g.shape) + rank)
    for a, s in zip(run, sizes):
        shape[a] = s
    shape[len(g.shape) + dim] = c
    order = sorted(range(len(run)), key=lambda j: run[j]) + [len(run)]
    return rows.transpose(order).reshape(shape)
