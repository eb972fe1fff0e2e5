"""Halo planning for sliding-window ops (ONNX layout ``N, C, *spatial``) on ceil-rule shards: output sizes, the
halo each shard needs from its neighbours (rows, hops, bytes), and extending blocks to their input windows (the
rows each device holds or receives, the rest fill). The kernels that run on those windows are in ``kernels``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from math import prod
from typing import NamedTuple, Sequence

import numpy as np

from ..backends import xp as _xp


def _ceil_div(n: int, k: int) -> int:
    return -(-n // k)


def _span(kernel: int, dilation: int) -> int:
    """Input rows one window covers, first tap to last."""
    return (kernel - 1) * dilation + 1


def _taps_inside(start: np.ndarray, n_in: int, kernel: int, dilation: int) -> tuple[np.ndarray, np.ndarray]:
    """For windows starting at global rows ``start``, the taps ``[j_lo, j_hi)`` that land in ``[0, n_in)``."""
    j_lo = np.maximum(0, -(start // dilation))
    j_hi = np.minimum(kernel, -((start - n_in) // dilation))
    return j_lo, j_hi


# ---- window arithmetic ---------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def out_size(n: int, kernel: int, stride: int = 1, dilation: int = 1, pad_lo: int = 0, pad_hi: int = 0) -> int:
    """Output length of a window op in floor mode (ONNX, PyTorch); 0 when no window fits."""
    return max(0, (n + pad_lo + pad_hi - _span(kernel, dilation)) // stride + 1)


@dataclass(frozen=True)
class Halo:
    """How the ``k`` ceil-rule shards of one dim get their input windows.

    Device ``p`` computes output rows ``[p*co, p*co + co)`` (``co = ceil(n_out/k)``; rows past ``n_out``
    are padding of the output block) from the input window of fixed ``width`` starting at global row
    ``lo[p]``. Its *real* output rows' taps that land in ``[0, n_in)`` span ``need[p] = [a, b)``; from each
    device ``s`` it receives the slab ``slabs[p][s]`` (global rows, empty as ``(0, 0)``) from the first to
    the last of those rows that ``s`` holds, so a device none of whose rows are read (a dilated window
    skipping a one-row block) sends nothing: ``left[p]`` rows from devices before it, ``right[p]`` from
    devices after it, the farthest ``hops_left[p]`` / ``hops_right[p]`` devices away. A device whose output
    block is empty, or reads only padding, needs nothing (``need == (0, 0)``).
    """

    n_in: int
    n_out: int
    k: int
    ci: int
    co: int
    width: int
    lo: tuple[int, ...]
    need: tuple[tuple[int, int], ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    hops_left: tuple[int, ...]
    hops_right: tuple[int, ...]
    slabs: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def max_left(self) -> int:
        """Rows received from the left, max over devices: the size of the rightward halo message."""
        return max(self.left)

    @property
    def max_right(self) -> int:
        """Rows received from the right, max over devices: the size of the leftward halo message."""
        return max(self.right)

    @property
    def max_hops(self) -> int:
        """Farthest neighbour any device reads from (1 for an ordinary halo, 0 for none)."""
        return max(self.hops_left + self.hops_right)

    def rows_from(self, distance: int) -> tuple[int, int]:
        """Max over devices of the rows received from the device ``distance`` to the left and to the right:
        the size of the one collective_permute per distance and direction that a multi-hop halo takes."""
        lft = rgt = 0
        for p, row in enumerate(self.slabs):
            if p - distance >= 0:
                a, b = row[p - distance]
                lft = max(lft, b - a)
            if p + distance < self.k:
                a, b = row[p + distance]
                rgt = max(rgt, b - a)
        return lft, rgt



@lru_cache(maxsize=4096)
def halo(n_in: int, n_out: int, k: int, kernel: int, stride: int = 1, dilation: int = 1,
         pad_lo: int = 0) -> Halo:
    """The windows and halo rows of a dim of ``n_in`` inputs / ``n_out`` outputs, both split over ``k``
    devices by the ceil rule (``pad_hi`` is implied by ``n_out``)."""
    if n_out < 1 or k < 1:
        raise ValueError(f"halo needs n_out >= 1 and k >= 1, got n_out={n_out}, k={k}")
    ci, co = _ceil_div(n_in, k), _ceil_div(n_out, k)
    span = _span(kernel, dilation)
    width = (co - 1) * stride + span
    lo, need, left, right, hl, hr, slabs = [], [], [], [], [], [], []
    for p in range(k):
        lo.append(p * co * stride - pad_lo)
        start = np.arange(p * co, min(n_out, (p + 1) * co)) * stride - pad_lo  # its real windows
        j_lo, j_hi = _taps_inside(start, n_in, kernel, dilation)
        hit = j_hi > j_lo  # with stride or dilation gaps, some windows may touch padding only
        a = int((start + j_lo * dilation)[hit].min()) if hit.any() else 0
        b = int((start + (j_hi - 1) * dilation)[hit].max()) + 1 if hit.any() else 0
        need.append((a, b))
        taps = start[:, None] + np.arange(kernel) * dilation
        read = np.unique(taps[(taps >= 0) & (taps < n_in)])  # the rows its real windows read
        owner = read // ci
        row = []
        for s in range(k):
            mine = read[owner == s]
            row.append((int(mine[0]), int(mine[-1]) + 1) if mine.size else (0, 0))
        slabs.append(tuple(row))
        nl = sum(e - b0 for b0, e in row[:p])
        nr = sum(e - b0 for b0, e in row[p + 1:])
        left.append(nl)
        right.append(nr)
        hl.append(p - min(s for s in range(p) if row[s][1] > row[s][0]) if nl else 0)
        hr.append(max(s for s in range(p + 1, k) if row[s][1] > row[s][0]) - p if nr else 0)
    return Halo(n_in, n_out, k, ci, co, width, tuple(lo), tuple(need), tuple(left), tuple(right),
                tuple(hl), tuple(hr), tuple(slabs))


def halo_bytes(h: Halo, row_bytes: int) -> tuple[int, int]:
    """Bytes per device of the halo exchange, (from the left, from the right): the max over devices of
    rows received times the bytes of one row of the block (every other block dim times the itemsize)."""
    return h.max_left * row_bytes, h.max_right * row_bytes


@lru_cache(maxsize=1024)
def _gather_plan(h: Halo) -> tuple[np.ndarray, np.ndarray]:
    """Per device and window row: the index into the padded global dim, and whether the row holds data
    the device has (its own block or its received halo) rather than padding."""
    rows = np.asarray(h.lo)[:, None] + np.arange(h.width)  # (k, W) global rows
    p = np.arange(h.k)[:, None]
    own = (rows >= p * h.ci) & (rows < (p + 1) * h.ci)
    got = np.zeros_like(own)
    for q, row in enumerate(h.slabs):
        for s, (a, b) in enumerate(row):
            if s != q and b > a:
                got[q] |= (rows[q] >= a) & (rows[q] < b)
    keep = (rows >= 0) & (rows < h.n_in) & (own | got)
    idx = np.clip(rows, 0, h.k * h.ci - 1)
    idx.setflags(write=False)
    keep.setflags(write=False)
    return idx, keep


def fill_value(fill: float, dtype: np.dtype) -> np.ndarray:
    """``fill`` in ``dtype``; infinities become the dtype's extremes so ``-inf`` works for integer max pools."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return np.asarray(fill > 0)
    if dtype.kind in "iu" and not np.isfinite(fill):
        info = np.iinfo(dtype)
        return np.asarray(info.min if fill < 0 else info.max, dtype=dtype)
    return np.asarray(fill, dtype=dtype)


# ---- block extension ------------------------------------------------------------------------------


def extend(x: np.ndarray, axis: int, G: int, grid_axes: Sequence[int], n_in: int, n_out: int, kernel: int,
           stride: int = 1, dilation: int = 1, pad_lo: int = 0, fill: float = 0) -> np.ndarray:
    """Replace each device's block along block dim ``axis`` by its input window (``halo(...).width`` rows
    from global row ``lo[p]``), ``fill`` where the row is padding or not received.

    The dim's shards lie on ``grid_axes`` (major to minor, product ``k``; empty when the dim is not
    sharded, which just pads it). One gather for all devices: the grid axes are merged into the dim, which
    is indexed as the padded global dim of ``k * ci`` rows, and split back (a view; block dims contiguous).
    """
    grid_axes = tuple(grid_axes)
    m = len(grid_axes)
    xp = _xp(x)
    sizes = tuple(x.shape[g] for g in grid_axes)
    h = halo(n_in, n_out, prod(sizes), kernel, stride, dilation, pad_lo)
    if x.shape[G + axis] != h.ci:
        raise ValueError(f"block dim {axis} has {x.shape[G + axis]} rows, expected ceil({n_in}/{h.k}) = {h.ci}")
    padding = fill_value(fill, x.dtype)
    if h.k == 1:  # not sharded: plain padding (and trimming of the floor-mode tail), by slices
        lo = h.lo[0]
        a, b = max(0, lo), min(n_in, lo + h.width)
        pre = (slice(None),) * (G + axis)
        body = x[pre + (slice(a, b),)] if b > a else x[pre + (slice(0, 0),)]
        before = a - lo if b > a else h.width
        after = h.width - before - (b - a if b > a else 0)
        pad = [(0, 0)] * x.ndim
        pad[G + axis] = (before, after)
        return xp.pad(body, pad, constant_values=padding)
    idx, keep = _gather_plan(h)
    d = G - m + axis  # where the padded global dim sits once the grid axes are merged into it
    y = xp.moveaxis(x, grid_axes, [d + i for i in range(m)])
    y = y.reshape(y.shape[:d] + (h.k * h.ci,) + y.shape[d + m + 1:])
    z = xp.take(y, idx, axis=d)  # (..., k, W, ...)
    if not keep.all():
        mask = keep.reshape(keep.shape + (1,) * (z.ndim - d - 2))
        z = xp.where(mask, z, padding)
    z = z.reshape(z.shape[:d] + sizes + z.shape[d + 1:])
    return xp.moveaxis(z, [d + i for i in range(m)], grid_axes)


class Piece(NamedTuple):
    """Devices ``[p0, p1)`` of a dim each receive ``count`` rows, from local row ``src`` of the device ``shift``
    places away into row ``dst`` of their window (``count == 0``: rows ``[dst, src)`` of the window are ``fill``)."""

    p0: int
    p1: int
    shift: int
    src: int
    dst: int
    count: int


@lru_cache(maxsize=1024)
def copy_plan(h: Halo) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """What each device's window along one dim is made of: the rows it reads (``need``) that it holds or
    receives, as copies from one source block each, and the rest of the window as fill. Devices next to each
    other with the same copy are one piece, so a dim sharded on one grid axis takes a few slice copies."""
    copies: list[tuple[int, int, int, int, int]] = []
    fills: list[tuple[int, int, int, int, int]] = []
    for p in range(h.k):
        lo = h.lo[p]
        a, b = h.need[p]
        a, b = max(a, lo, 0), min(b, lo + h.width, h.n_in)
        covered = np.zeros(h.width, dtype=bool)
        for s in range(h.k):
            if s == p:  # what it holds of its window
                r0, r1 = max(a, s * h.ci), min(b, (s + 1) * h.ci)
            else:  # the slab it receives from s
                r0, r1 = h.slabs[p][s]
                r0, r1 = max(r0, lo), min(r1, lo + h.width)
            if r1 > r0:
                copies.append((p, s - p, r0 - s * h.ci, r0 - lo, r1 - r0))
                covered[r0 - lo:r1 - lo] = True
        edges = np.flatnonzero(np.diff(np.concatenate(([0], ~covered, [0])).astype(np.int8)))
        for f0, f1 in zip(edges[::2], edges[1::2]):
            fills.append((p, 0, int(f1), int(f0), 0))

    def runs(items):
        out: list[Piece] = []
        for p, *rest in sorted(items, key=lambda t: (t[1:], t[0])):
            if out and out[-1].p1 == p and (out[-1].shift, out[-1].src, out[-1].dst, out[-1].count) == tuple(rest):
                out[-1] = out[-1]._replace(p1=p + 1)
            else:
                out.append(Piece(p, p + 1, *rest))
        return tuple(out)

    return runs(copies), runs(fills)


def _is_identity(h: Halo, pad_lo: int, kernel: int, stride: int, dilation: int) -> bool:
    """Every device's window is its own block and no real output reads padding (a 1x1 stride-1 conv, or any
    window op on a dim whose blocks need nothing more): the block is its window as it is."""
    return (h.width == h.ci and pad_lo == 0 and all(lo == p * h.ci for p, lo in enumerate(h.lo))
            and (h.n_out - 1) * stride + _span(kernel, dilation) <= h.n_in)


def extend_many(x: np.ndarray, G: int, dims: Sequence[tuple], fill: float = 0) -> np.ndarray:
    """:func:`extend` along several block dims at once (numpy blocks): one buffer of the windows' shape, into
    which each device's rows (its own and its halo) are copied by slices, and the rest set to ``fill``. Each
    entry of ``dims`` is ``(axis, grid_axes, n_in, n_out, kernel, stride, dilation, pad_lo)``. Along a sharded dim
    of 1-wide windows with a stride (a strided slice, a 1x1 conv's downsampling), only the rows the windows read
    are copied: the rows between them, which no window op reads, are left unset (whole dims are copied whole, a
    contiguous copy being faster)."""
    shape = list(x.shape)
    plans = []
    for axis, grid_axes, n_in, n_out, kernel, stride, dilation, pad_lo in dims:
        grid_axes = tuple(grid_axes)
        sizes = tuple(x.shape[g] for g in grid_axes)
        h = halo(n_in, n_out, prod(sizes), kernel, stride, dilation, pad_lo)
        if x.shape[G + axis] != h.ci:
            raise ValueError(f"block dim {axis} has {x.shape[G + axis]} rows, expected ceil({n_in}/{h.k}) = {h.ci}")
        if _is_identity(h, pad_lo, kernel, stride, dilation):
            continue
        shape[G + axis] = h.width
        plans.append((G + axis, grid_axes, sizes, h, stride if kernel == 1 and h.k > 1 else 1))
    if not plans:
        return x
    if all(h.k == 1 and 0 <= h.lo[0] and h.lo[0] + h.width <= h.n_in for _, _, _, h, _ in plans):
        key = [slice(None)] * x.ndim  # unsharded and inside the dim: the window is a view of the block
        for d, _, _, h, _ in plans:
            key[d] = slice(h.lo[0], h.lo[0] + h.width)
        return x[tuple(key)]
    plans = [(d, ga, sizes, copy_plan(h), step) for d, ga, sizes, h, step in plans]
    out = np.empty(shape, dtype=x.dtype)
    full = (slice(None),) * x.ndim

    def devices(key: list, grid_axes, sizes, p0: int, p1: int) -> bool:
        """Select devices ``[p0, p1)`` of a dim on its grid axes in ``key``; False if that is no one slice."""
        if len(grid_axes) == 1:
            key[grid_axes[0]] = slice(p0, p1)
        elif len(grid_axes) > 1:
            if p1 - p0 != 1:
                return False
            for g, i in zip(grid_axes, np.unravel_index(p0, sizes)):
                key[g] = int(i)
        return True

    def split(piece: Piece, grid_axes) -> list[Piece]:
        return [piece] if len(grid_axes) <= 1 else [piece._replace(p0=p, p1=p + 1) for p in range(piece.p0, piece.p1)]

    per_dim = [[q for c in copies for q in split(c, ga)] for _, ga, _, (copies, _), _ in plans]
    for combo in product(*per_dim):
        dst, src = list(full), list(full)
        for (d, grid_axes, sizes, _, step), c in zip(plans, combo):
            devices(dst, grid_axes, sizes, c.p0, c.p1)
            devices(src, grid_axes, sizes, c.p0 + c.shift, c.p1 + c.shift)
            skip = -c.dst % step  # to the first row a window reads
            dst[d] = slice(c.dst + skip, c.dst + c.count, step)
            src[d] = slice(c.src + skip, c.src + c.count, step)
        out[tuple(dst)] = x[tuple(src)]
    value = fill_value(fill, x.dtype)
    for d, grid_axes, sizes, (_, fills), _ in plans:
        for f in fills:
            for q in split(f, grid_axes):
                key = list(full)
                devices(key, grid_axes, sizes, q.p0, q.p1)
                key[d] = slice(q.dst, q.src)
                out[tuple(key)] = value
    return out
