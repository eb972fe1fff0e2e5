"""Simulated collectives as array moves along grid atoms of vectorised storage (all_gather moves atoms
into a dim, all_to_all/reduce_scatter/slices move part of a dim onto atoms, all_reduce sums over atoms,
collective_permute reorders blocks), and the comm log that records every one."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from math import prod
from typing import Iterator, Sequence

import numpy as np

from .array_backend import xp

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "collective_permute")


# ---- array moves ---------------------------------------------------------------------------------


def gather_into(x: np.ndarray, G: int, dim: int, atoms: Sequence[int], new_chunk: int) -> np.ndarray:
    """Move grid ``atoms`` (major to minor) to the minor end of ``dim``; they become replicas (size 1)."""
    m = len(atoms)
    if m == 0:
        return _fit(x, G + dim, new_chunk)
    y = xp(x).moveaxis(x, list(atoms), [G - m + dim + i for i in range(m)])
    shp = y.shape
    c = shp[G + dim]
    merged = shp[:G - m + dim] + (prod(shp[G - m + dim:G + dim]) * c,) + shp[G + dim + 1:]
    y = y.reshape(merged)
    keep = [j for j in range(G) if j not in set(atoms)]
    grid = [1] * G
    for j, s in zip(keep, y.shape[:G - m]):
        grid[j] = s
    y = y.reshape(tuple(grid) + y.shape[G - m:])
    return _fit(y, G + dim, new_chunk)


def split_onto(x: np.ndarray, G: int, dim: int, atoms: Sequence[int], sizes: Sequence[int],
               new_chunk: int) -> np.ndarray:
    """Cut the minor end of ``dim`` into ``sizes`` pieces placed on grid ``atoms`` (currently size 1)."""
    m = len(atoms)
    if m == 0:
        return _fit(x, G + dim, new_chunk)
    k = prod(sizes)
    x = _fit(x, G + dim, k * new_chunk)
    keep = tuple(s for j, s in enumerate(x.shape[:G]) if j not in set(atoms))
    y = x.reshape(keep + x.shape[G:G + dim] + tuple(sizes) + (new_chunk,) + x.shape[G + dim + 1:])
    src = [G - m + dim + i for i in range(m)]
    order = sorted(range(m), key=lambda i: atoms[i])
    return xp(y).moveaxis(y, [src[i] for i in order], [atoms[i] for i in order])


def reduce_over(x: np.ndarray, atoms: Sequence[int], op: str = "sum") -> np.ndarray:
    fn = getattr(xp(x), op)
    return fn(x, axis=tuple(atoms), keepdims=True)


def permute_blocks(x: np.ndarray, dim_before: Sequence[int], dim_after: Sequence[int]) -> np.ndarray:
    """Devices that held block ``radix(coords, before)`` of a dim now hold ``radix(coords, after)``."""
    sizes = {a: x.shape[a] for a in dim_before}
    by_pos = xp(x).moveaxis(x, list(dim_before), list(range(len(dim_before))))
    rest = by_pos.shape[len(dim_before):]
    by_pos = by_pos.reshape((prod(sizes.values()),) + rest)
    y = by_pos.reshape(tuple(sizes[a] for a in dim_after) + rest)
    return xp(y).moveaxis(y, list(range(len(dim_after))), list(dim_after))


def _fit(x: np.ndarray, axis: int, n: int) -> np.ndarray:
    """Trim or zero-pad ``axis`` to ``n``: padding past a dim's end carries no value."""
    c = x.shape[axis]
    if c == n:
        return x
    if c > n:
        return x[(slice(None),) * axis + (slice(0, n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - c)
    return xp(x).pad(x, pad)


# ---- the comm log --------------------------------------------------------------------------------

ALPHA = 5e-6  # seconds per ring step (latency)
BETA = 1 / 25e9  # seconds per byte (inverse link bandwidth)


@dataclass(frozen=True)
class CommEvent:
    """One collective: its kind, mesh axes, bytes sent per device (ring), group size, and an alpha-beta cost."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    group: int = 1
    op: str = ""

    @property
    def steps(self) -> int:
        k = self.group
        return {"all_reduce": 2 * (k - 1), "collective_permute": 1}.get(self.kind, k - 1)

    @property
    def cost(self) -> float:
        """Estimated seconds: ring steps times latency plus bytes over bandwidth."""
        return self.steps * ALPHA + self.bytes * BETA

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(self.axes)}; {self.bytes} B/device{'; ' + self.op if self.op else ''})"


@dataclass
class CommLog:
    """Every simulated collective run while the log is active (``with nb.comm_log() as log:``)."""

    events: list[CommEvent] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.kind] = out.get(e.kind, 0) + 1
        return out

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.events)

    @property
    def total_cost(self) -> float:
        return sum(e.cost for e in self.events)

    def summary(self) -> str:
        """A readable table: one row per event, then totals."""
        rows = [("#", "kind", "axes", "group", "bytes/device", "est. us", "during")]
        for i, e in enumerate(self.events):
            rows.append((str(i), e.kind, ",".join(e.axes), str(e.group), f"{e.bytes:,}", f"{e.cost * 1e6:.1f}", e.op))
        rows.append(("", "total", "", "", f"{self.total_bytes:,}", f"{self.total_cost * 1e6:.1f}", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def clear(self) -> None:
        self.events.clear()


_active: list[CommLog] = []


@contextlib.contextmanager
def comm_log() -> Iterator[CommLog]:
    """Record the collectives run inside the block; logs nest (an outer log sees inner events too)."""
    log = CommLog()
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def logging() -> bool:
    """Whether any comm log is open (callers skip building events when none is)."""
    return bool(_active)


def record(event: CommEvent) -> None:
    for log in _active:
        log.events.append(event)
