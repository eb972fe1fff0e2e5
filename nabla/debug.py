"""Terminal drawings of where blocks live (``nb.visualize_sharding``)."""

from __future__ import annotations

from typing import Any

from .errors import ShardingError


def visualize_sharding(t: Any, show: bool = True) -> str:
    """A grid of the tensor's blocks (1-D or 2-D), each cell listing its slice and the devices holding it."""
    spec = t.sharding
    shape = t.shape
    if spec is None:
        text = f"unsharded host tensor, shape {shape}"
    else:
        if len(shape) > 2:
            raise ShardingError(f"visualize_sharding: draws rank 1 or 2 tensors, got shape {shape}")
        cells: dict[tuple, list[int]] = {}
        for d in spec.mesh.devices:
            sl = spec.shard_slices(shape, d)
            cells.setdefault(tuple((s.start, s.stop) for s in sl), []).append(d)
        rows = sorted({k[0] for k in cells}) if shape else [(0, 1)]
        cols = sorted({k[1] for k in cells}) if len(shape) == 2 else [None]
        grid = []
        for r in rows:
            line = []
            for c in cols:
                key = (r, c) if c is not None else ((r,) if shape else ())
                devs = cells.get(key, [])
                where = f"[{r[0]}:{r[1]}" + (f", {c[0]}:{c[1]}]" if c is not None else "]") if shape else "[]"
                line.append(f"{where} dev {','.join(map(str, devs))}" if devs else f"{where} -")
            grid.append(line)
        width = max(len(x) for line in grid for x in line)
        sep = "+" + "+".join("-" * (width + 2) for _ in cols) + "+"
        out = [f"{spec!r} on {spec.mesh!r}, shape {shape}", sep]
        for line in grid:
            out.append("| " + " | ".join(x.ljust(width) for x in line) + " |")
            out.append(sep)
        if spec.partial_axes:
            out.append(f"partial sums over {list(spec.partial_axes)}: the value is the sum of the blocks")
        text = "\n".join(out)
    if show:
        print(text)
    return text
