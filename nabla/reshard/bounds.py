"""What no reshard plan can beat: each device's block as boxes (the ceil rule), the bytes each device lacks of
its target block, and ``lower_bound`` (with pending sums, the messages every element's sum needs)."""

from __future__ import annotations

from functools import lru_cache
from math import prod

import numpy as np

from ..layout import chunk
from ..spec import ShardingSpec


@lru_cache(maxsize=8)  # a million-device mesh's is 24 MB
def grid_coords(shape: tuple[int, ...]) -> np.ndarray:
    """Each device's coordinates, devices in mesh order (row-major over ``shape``), one row each."""
    n = prod(shape)
    if not shape:
        return np.zeros((n, 0), dtype=np.int64)
    out = np.stack(np.unravel_index(np.arange(n, dtype=np.int64), shape), axis=-1).astype(np.int64)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=4096)
def boxes(spec: ShardingSpec, shape: tuple[int, ...]) -> np.ndarray:
    """(devices in mesh order, rank, 2): each device's block as [start, stop) per dim (the ceil rule)."""
    mesh = spec.mesh
    coords = np.array([mesh.coords(d) for d in mesh.devices], dtype=np.int64).reshape(mesh.size, mesh.ndim)
    out = np.zeros((mesh.size, len(shape), 2), dtype=np.int64)
    for j, (refs, n) in enumerate(zip(spec.dim_refs, shape)):
        pos = np.zeros(mesh.size, dtype=np.int64)
        for r in refs:
            pos = pos * r.size + (coords[:, mesh.axis_index(r.name)] // r.minor) % r.size
        c = chunk(n, spec.num_shards(j))
        out[:, j, 0] = np.minimum(n, pos * c)
        out[:, j, 1] = np.minimum(n, out[:, j, 0] + c)
    return out


def lacking(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> np.ndarray:
    """Per device (mesh order), the bytes of its ``dst`` block that its ``src`` block does not hold."""
    s, t = boxes(src.layout(), tuple(shape)), boxes(dst.layout(), tuple(shape))
    need = np.prod(t[..., 1] - t[..., 0], axis=1)
    lo, hi = np.maximum(s[..., 0], t[..., 0]), np.minimum(s[..., 1], t[..., 1])
    held = np.prod(np.maximum(hi - lo, 0), axis=1)
    return (need - held) * itemsize


def lower_bound(shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec) -> int:
    """Bytes per device that no plan can beat (a plan's bytes are, step by step, what each device sends, and
    in every collective a device receives what it sends).

    Without pending sums: the most any device lacks of its target block. Summing the partial values over the
    ``k`` coordinates of the partial axes the target drops: the larger of (a) the most any device must
    receive, one value per element of its target block (it holds at most one of the ``k`` summands), and
    (b) the messages every element needs, shared evenly over the devices. For (b), per element and kept
    partial coordinate, with ``D`` devices needing the sum: take the first device ``f`` to hold the whole
    sum. Before it does, every summand ``f`` lacks has been sent by a device holding it (a device holds one
    summand, so these are distinct sends): ``k - 1`` if ``f`` holds a summand, else ``k``. After it, each of
    the other devices needing the sum receives at least once: ``D - 1`` if ``f`` needs it, else ``D``. So
    ``k + D - 1 - both`` messages, ``both`` when one device holds a summand and needs the sum. For an
    all_reduce (``D = k``, every device both) that is ``2(k - 1)`` messages per element, ``2(k - 1)/k`` of
    the block per device: the bound ring all-reduce meets, proved optimal by Patarasuk and Yuan, "Bandwidth
    optimal all-reduce algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009
    (and the one-way gossip bound of ``2n - 2`` calls); for a reduce_scatter (``D = 1``) ``(k - 1)/k``.
    Like the ring formulas, (b) counts pieces of values and rounds bytes down; the sums are those of the
    kept partial coordinates (what the planner's reductions produce)."""
    src, dst = src.layout(), dst.layout()
    lack = int(lacking(shape, itemsize, src, dst).max(initial=0))
    kept = set(dst.partial_refs)
    reduced = [r for r in src.partial_refs if r not in kept]
    if not reduced:
        return lack
    # sub-axes: the target may keep part of a source partial axis; count summands on the finest atoms
    k = prod(r.size for r in src.partial_refs) // prod(r.size for r in dst.partial_refs)
    if k == 1:
        return lack
    mesh = src.mesh
    kept_coord = np.array([_radix(mesh, dst.partial_refs, d) for d in mesh.devices], dtype=np.int64)
    return max(lack, _sum_bound(tuple(shape), itemsize, boxes(src, tuple(shape)), boxes(dst, tuple(shape)),
                                kept_coord, k))


def _sum_bound(shape, itemsize: int, sb: np.ndarray, tb: np.ndarray, kept_coord: np.ndarray, k: int) -> int:
    """``lower_bound`` with pending sums, from each device's source and target box (devices, rank, 2), its
    coordinate on the kept partial axes, and the number ``k`` of summands each kept sum adds."""
    need = np.prod(tb[..., 1] - tb[..., 0], axis=1)
    # elements in cells between every block boundary: within a cell all devices agree on holding/needing it
    edges = [np.unique(np.concatenate([[0, n], sb[:, j].ravel(), tb[:, j].ravel()])) for j, n in enumerate(shape)]
    lo = [e[:-1] for e in edges]
    width = [np.diff(e) for e in edges]
    cell = np.ones(tuple(len(w) for w in width), dtype=np.int64)
    for j, w in enumerate(width):
        cell = cell * w.reshape((1,) * j + (-1,) + (1,) * (len(shape) - j - 1))
    msgs = 0
    for c in np.unique(kept_coord):
        on = kept_coord == c
        sinks = np.ones((int(on.sum()),) + cell.shape, dtype=bool)
        both = sinks.copy()
        for j in range(len(shape)):
            at = (slice(None),) + (None,) * j + (slice(None),) + (None,) * (len(shape) - j - 1)
            x = lo[j][None, :]
            t_in = (tb[on, j, 0][:, None] <= x) & (x < tb[on, j, 1][:, None])
            s_in = (sb[on, j, 0][:, None] <= x) & (x < sb[on, j, 1][:, None])
            sinks = sinks & t_in[at]
            both = both & (t_in & s_in)[at]
        per = k + sinks.sum(axis=0) - 1 - both.any(axis=0)
        msgs += int((per * cell).sum())
    spread = msgs * itemsize // len(sb)  # bytes, as ring collectives count them (pieces of values, rounded down)
    return max(int(need.max(initial=0)) * itemsize, spread)


def _radix(mesh, refs, device: int) -> int:
    coords = mesh.coords(device)
    pos = 0
    for r in refs:
        pos = pos * r.size + r.coord(coords[mesh.axis_index(r.name)])
    return pos
