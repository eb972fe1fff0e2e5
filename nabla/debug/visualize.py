"""``nb.visualize_sharding``: which device holds which block of a tensor (a rich picture in a terminal, plain text
otherwise), and ``short``, the short form of a spec nabla's docs and ``nb.explain`` print."""

from __future__ import annotations

import io
import sys
from typing import Any, NamedTuple

from ..errors import ShardingError
from ..tensor import Tensor


# ---- notation -------------------------------------------------------------------------------------------


def short(spec: Any) -> str:
    """The short form of a spec used in nabla's docs: one entry per dim between ``|``, ``-`` for a replicated
    dim, axes joined by ``,``, ``?`` for an open dim; partial axes follow as ``Σ`` (``[dp|-]``, ``[-|tp] Σdp``)."""
    if spec is None:
        return "host"
    dims = []
    for d in spec.dim_specs:
        s = ",".join(d.axes) if d.axes else ("" if d.is_open else "-")
        dims.append(s + ("?" if d.is_open else ""))
    out = "[" + "|".join(dims) + "]"
    if spec.partial_axes:
        out += " Σ" + ",".join(spec.partial_axes)
    return out


# ---- visualize_sharding ------------------------------------------------------------------------------------

# Background colours for device groups (matplotlib's tab20, as jax.debug.visualize_array_sharding uses).
_PALETTE = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
            "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2", "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d",
            "#17becf", "#9edae5"]


def _runs(devs: list[int]) -> str:
    """``0,1,2,3,6`` as ``0-3,6``."""
    devs = sorted(devs)
    out, i = [], 0
    while i < len(devs):
        j = i
        while j + 1 < len(devs) and devs[j + 1] == devs[j] + 1:
            j += 1
        out.append(f"{devs[i]}-{devs[j]}" if j - i >= 2 else ",".join(map(str, devs[i:j + 1])))
        i = j + 1
    return ",".join(out)


class _Cell(NamedTuple):
    rows: tuple[int, int] | None  # dim 0's [start, stop), None for a 0-d tensor
    cols: tuple[int, int] | None  # dim 1's, None below rank 2
    blocks: tuple[tuple[tuple, tuple[int, ...]], ...]  # per block of the dims past 1: (their slices, devices)


class _Picture(NamedTuple):
    title: str
    rows: list  # dim 0's distinct non-empty [start, stop) (or [None])
    cols: list
    cells: dict
    notes: list[str]
    partial: bool
    tail_cut: bool  # a dim past 1 is sharded: cells list their blocks there

    def label(self, key: tuple, ndim: int) -> list[str]:
        return _label(self.cells[key], ndim, self.partial, self.tail_cut)


def _picture(t: Any, max_width: int = 80) -> _Picture:
    spec, shape = t.sharding, tuple(t.shape)
    mesh = spec.mesh
    notes: list[str] = []
    cells: dict[tuple, dict[tuple, list[int]]] = {}
    empty: list[int] = []
    # a 1-D tensor is drawn as one row of blocks (as jax draws it) when they fit across, else as a column
    across = len(shape) == 1 and spec.num_shards(0) * (12 + 2 * len(str(shape[0]))) <= max_width
    for d in mesh.devices:
        sl = spec.shard_slices(shape, d)
        if any(s.stop == s.start for s in sl):
            empty.append(d)
            continue
        spans = [(s.start, s.stop) for s in sl]
        if across:
            r, c = None, spans[0]
        else:
            r = spans[0] if shape else None
            c = spans[1] if len(shape) >= 2 else None
        cells.setdefault((r, c), {}).setdefault(tuple(spans[2:]), []).append(d)
    rows = sorted({k[0] for k in cells}, key=lambda x: x or (0, 0)) or [None]
    cols = sorted({k[1] for k in cells}, key=lambda x: x or (0, 0)) or [None]
    for i, n in enumerate(shape):
        k = spec.num_shards(i)
        if k > 1 and n % k:
            c = -(-n // k)
            sizes = [max(0, min(n, (j + 1) * c) - j * c) for j in range(k)]
            notes.append(f"uneven: dim {i} of size {n} over {k} shards gives blocks of "
                         f"{', '.join(map(str, sizes))} (ceil rule)")
    if empty:
        notes.append(f"empty blocks (nothing left for them under the ceil rule): device{'s' if len(empty) > 1 else ''} "
                     f"{_runs(empty)}")
    if spec.partial_axes:
        notes.append(f"partial sums over {list(spec.partial_axes)} (Σ): each cell's value is the sum of the blocks "
                     f"its devices hold over those axes")
    if len(shape) > 2:
        sharded = [i for i in range(2, len(shape)) if spec.num_shards(i) > 1]
        rest = "dim 2 is" if len(shape) == 3 else f"dims 2-{len(shape) - 1} are"
        notes.append(f"rank {len(shape)}: the grid shows dims 0 and 1; "
                     + (f"dim{'s' if len(sharded) > 1 else ''} {', '.join(map(str, sharded))} "
                        f"{'are' if len(sharded) > 1 else 'is'} sharded too: each cell lists its blocks there"
                        if sharded else f"{rest} whole on every device"))
    title = f"{spec!r} on {mesh!r}, shape {shape}"
    out = {k: _Cell(k[0], k[1], tuple((tail, tuple(v)) for tail, v in sorted(blocks.items())))
           for k, blocks in cells.items()}
    tail_cut = any(spec.num_shards(i) > 1 for i in range(2, len(shape)))
    return _Picture(title, rows, cols, out, notes, bool(spec.partial_axes), tail_cut)


def _where(cell: _Cell, ndim: int) -> str:
    parts = []
    if cell.rows is not None:
        parts.append(f"{cell.rows[0]}:{cell.rows[1]}")
    if cell.cols is not None:
        parts.append(f"{cell.cols[0]}:{cell.cols[1]}")
    if ndim > 2:
        parts.append("...")
    return "[" + ", ".join(parts) + "]"


def _label(cell: _Cell, ndim: int, partial: bool, tail_cut: bool) -> list[str]:
    """The lines of a cell: where it is, and which devices hold it (per block of the dims past 1 when those
    are sharded)."""
    sigma = "Σ " if partial else ""
    if not tail_cut:
        return [_where(cell, ndim), f"{sigma}dev {_runs([d for _, ds in cell.blocks for d in ds])}"]
    lines = [_where(cell, ndim)]
    for tail, devs in cell.blocks:
        lines.append(f"{sigma}dev {_runs(list(devs))}: [.., " + ", ".join(f"{a}:{b}" for a, b in tail) + "]")
    return lines


def render_sharding(t: Any, plain: bool = True, max_width: int = 80) -> str:
    """The picture ``visualize_sharding`` prints, as a string: plain text, or (``plain=False``) rich's
    rendering with ANSI colours (needs rich)."""
    spec = t.sharding
    if spec is None:
        return f"unsharded host tensor, shape {tuple(t.shape)}: one copy, on the host"
    pic = _picture(t, max_width)
    ndim = len(t.shape)
    if not plain:
        return _rich_text(pic, t, ndim, max_width)
    rows, cols = _elide(pic.rows, 8), _elide(pic.cols, 8)
    grid = []
    for r in rows:
        line = []
        for c in cols:
            cell = pic.cells.get((r, c)) if r is not _MORE and c is not _MORE else None
            if r is _MORE or c is _MORE:
                line.append("...")
            elif cell is None:
                line.append("-")
            else:
                lab = pic.label((r, c), ndim)
                line.append(lab[0] + " " + "; ".join(lab[1:]))
        grid.append(line)
    width = max(len(x) for line in grid for x in line)
    per_band = max(1, (max_width - 1) // (width + 3))  # columns of cells that fit in max_width
    out = [pic.title]
    for b in range(0, len(cols), per_band):
        band = range(b, min(len(cols), b + per_band))
        if len(cols) > per_band:
            out.append(f"(columns {b + 1}-{band[-1] + 1} of {len(cols)})")
        sep = "+" + "+".join("-" * (width + 2) for _ in band) + "+"
        out.append(sep)
        for line in grid:
            out.append("| " + " | ".join(line[j].ljust(width) for j in band) + " |")
            out.append(sep)
    if len(rows) < len(pic.rows) + (_MORE in rows) or len(cols) < len(pic.cols) + (_MORE in cols):
        out.append(f"... marks blocks left out: {len(pic.rows)} rows x {len(pic.cols)} columns of blocks in all")
    out += pic.notes
    return "\n".join(out)


_MORE = object()  # stands for the rows or columns of blocks left out of a picture


def _elide(items: list, most: int) -> list:
    """The first and last ``most // 2`` items, with ``_MORE`` between, when there are more than ``most``."""
    if len(items) <= most:
        return list(items)
    return list(items[:most // 2]) + [_MORE] + list(items[-(most // 2):])


def _rich_table(pic: _Picture, t: Any, ndim: int, max_width: int):
    from rich import box
    from rich.align import Align
    from rich.padding import Padding
    from rich.style import Style
    from rich.table import Table
    from rich.text import Text

    shape = tuple(t.shape)
    labels = {k: pic.label(k, ndim) for k in pic.cells}
    n_cols = max(1, shape[1] if ndim >= 2 else shape[0] if ndim == 1 and pic.rows == [None] else 1)
    n_rows = max(1, shape[0] if ndim >= 1 and pic.rows != [None] else 1)
    widest = {c: max(len(x) for (r, cc), lab in labels.items() if cc == c for x in lab) for c in pic.cols}
    room = max(max_width - 2, sum(widest.values()) + 2 * len(pic.cols))
    widths = {c: max(widest[c] + 2, round(room * ((c[1] - c[0]) / n_cols if c else 1))) for c in pic.cols}
    tall = {r: max(max(len(lab) for (rr, _), lab in labels.items() if rr == r) + 2,
                   round(4 * len(pic.rows) * ((r[1] - r[0]) / n_rows if r else 1))) for r in pic.rows}
    groups: dict[tuple, int] = {}
    table = Table(show_header=False, show_lines=False, padding=0, box=box.SQUARE, show_edge=True,
                  pad_edge=False, collapse_padding=True)
    for c in pic.cols:
        table.add_column(width=widths[c], no_wrap=True)
    for r in pic.rows:
        row = []
        for c in pic.cols:
            cell = pic.cells.get((r, c))
            if cell is None:
                row.append(Text(""))
                continue
            devs = tuple(d for _, ds in cell.blocks for d in ds)
            colour = _PALETTE[groups.setdefault(devs, len(groups)) % len(_PALETTE)]
            dark = colour in _PALETTE[0::2]
            text = Text("\n".join(labels[(r, c)]), justify="center")
            style = Style(bgcolor=colour, color="white" if dark else "black")
            row.append(Padding(Align(text, "center", vertical="middle", height=tall[r]), (0, 0), style=style,
                               expand=True))
        table.add_row(*row)
    return table


def _rich_text(pic: _Picture, t: Any, ndim: int, max_width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="truecolor", width=max_width + 2)
    _rich_print(console, pic, t, ndim, max_width)
    return buf.getvalue()


def _rich_print(console: Any, pic: _Picture, t: Any, ndim: int, max_width: int) -> None:
    console.print(pic.title, highlight=False, markup=False)
    console.print(_rich_table(pic, t, ndim, max_width))
    for n in pic.notes:
        console.print(n, highlight=False, markup=False)


def _has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def visualize_sharding(t: Any, plain: bool | None = None, max_width: int = 80, file: Any = None) -> None:
    """Print which devices hold which block of ``t`` (like ``jax.debug.visualize_array_sharding``): one cell per
    block of dims 0 and 1, coloured per device group, with its slice and devices; uneven and empty blocks,
    partial sums (Σ) and the dims past 1 of a higher-rank tensor are noted below. Drawn with rich when it is
    installed and the output is a terminal, in plain text otherwise (``plain=True`` forces it). ``max_width``
    bounds the picture: plain text puts as many columns of cells side by side as fit (a single wider cell
    stays whole) and leaves out the middle rows and columns of a grid of more than 8 x 8 blocks. Returns None."""
    if not isinstance(t, Tensor):
        raise ShardingError(f"visualize_sharding: expected a nabla Tensor, got {type(t).__name__} (place an array "
                            f"first: nb.tensor(a).shard(mesh, dim_specs))")
    out = sys.stdout if file is None else file
    if plain is None:
        plain = not (_has_rich() and hasattr(out, "isatty") and out.isatty())
    if not plain and not _has_rich():
        raise ShardingError("visualize_sharding(plain=False) needs rich: pip install 'nabla-spmd[viz]' (in a clone: pip install -e '.[viz]')")
    if plain or t.sharding is None:
        print(render_sharding(t, plain=True, max_width=max_width), file=out)
        return None
    from rich.console import Console
    _rich_print(Console(file=out, width=max_width + 2), _picture(t, max_width), t, len(t.shape), max_width)
    return None
