"""Seeing what happens: ``nb.visualize_sharding`` (which device holds which block: a rich picture in a terminal,
plain text otherwise) and ``nb.explain`` (op by op, the shardings propagation chose and every collective with its
reason and cost). Both read what the executor recorded; neither changes it."""

from __future__ import annotations

import html as _html
import inspect
import io
import sys
from typing import Any, NamedTuple

import numpy as np

from .errors import ShardingError
from .tensor import Tensor
from . import collectives as C
from .propagation import project_dim
from .rules.core import _names
from .spec import ShardingSpec
from .cost import current as current_cost_model
from .executor import Program
from .propagation import current_strategy
from .step import MOVE, PLACE, RELAYOUT, serial
from .jit import inlined

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


# ---- explain ---------------------------------------------------------------------------------------------


class _Line(NamedTuple):
    kind: str  # "operand", "factors", "result", "move", "why", "note"
    text: str


class _Step(NamedTuple):
    title: str
    lines: list
    events: list  # (CommEvent, seconds)


def _named_leaves(fn: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) for every leaf of the arguments, named after fn's parameters and the keys inside them."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        items = list(bound.arguments.items())
        params = inspect.signature(fn).parameters
        flat = []
        for k, v in items:
            if params[k].kind is inspect.Parameter.VAR_POSITIONAL:
                flat += [(f"{k}[{i}]", x) for i, x in enumerate(v)]
            elif params[k].kind is inspect.Parameter.VAR_KEYWORD:
                flat += [(f"{k}[{kk!r}]", x) for kk, x in v.items()]
            else:
                flat.append((k, v))
    except (TypeError, ValueError):
        flat = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []

    def walk(name, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}[{k!r}]", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{name}[{i}]", x)
        else:
            out.append((name, v))

    for name, v in flat:
        walk(name, v)
    return out


def _replace_leaves(tree: Any, table: dict[int, Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _replace_leaves(v, table) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_replace_leaves(v, table) for v in tree)
    return table.get(id(tree), tree)


def _type_of(shape: tuple[int, ...], dtype: Any) -> str:
    dt = np.dtype(dtype)
    short_dt = {"float32": "f32", "float64": "f64", "int64": "i64", "int32": "i32", "bool": "bool",
                "float16": "f16"}.get(dt.name, dt.name)
    return f"{short_dt}[{','.join(map(str, shape))}]"


def _events_cost(events, model) -> list:
    return [(e, model.time(C.REGISTRY[e.kind].ring_steps(e.group), e.bytes, e.axes)) for e in events]


def _ev_text(e: Any, seconds: float) -> str:
    return f"{e.kind} over {','.join(e.axes)} (group of {e.group}): {e.bytes:,} B/device, est. {seconds * 1e6:.1f} us"


def _factor_lines(step: Any, strat: str) -> tuple[list[str], Any, Any, list]:
    """The op's factors: each one's size, kind, what every operand says, and what propagation decided (read from
    the recorded program: nothing is propagated again)."""

    rule, dec, keep, _ = step.prog.decision
    names = _names(len(rule.sizes))
    windowed = frozenset(f for f in range(len(rule.sizes)) if rule.kinds[f].windowed)
    says: list[list[str]] = [[] for _ in rule.sizes]
    opinions: list[list[tuple]] = [[] for _ in rule.sizes]
    for k, (u, dims) in enumerate(zip(step.uses, rule.operands)):
        spec = u.src
        if not isinstance(spec, ShardingSpec):
            continue
        for ds, refs, factors in zip(spec.dim_specs, spec.dim_refs, dims):
            for f, axes in project_dim(refs, factors, rule.sizes, windowed).items():
                names_ = [str(r) for r in axes]
                says[f].append(f"op{k} [{','.join(names_)}]{'?' if ds.is_open else ''}"
                               + (f"p{ds.priority}" if ds.priority else ""))
                opinions[f].append((k, tuple(names_), ds.is_open, ds.priority))
    lines = [f"rule {rule}" + (f"; pending sums kept over {sorted(keep)}" if keep else "")]
    for f, n in enumerate(rule.sizes):
        kind = rule.kinds[f]
        tag = kind.name + (", contracting" if kind.contracting else "")
        decided = ",".join(str(r) for r in dec.factors[f])
        lines.append(f"factor {names[f]}={n} ({tag}): {' '.join(says[f]) or 'no operand sharded'} -> [{decided}]")
    return lines, rule, dec, opinions


def _tensor_size(rule: Any, k: int) -> int:
    n = 1
    for dim in rule.operands[k]:
        for f in dim:
            n *= rule.sizes[f]
    return n


def _why_dim(f: int, rule: Any, dec: Any, opinions: list, strat: str) -> str:
    """A reason for factor ``f``'s decided axes, following the order in which propagation resolves conflicts."""
    names = _names(len(rule.sizes))
    got = tuple(str(r) for r in dec.factors[f])
    ops = opinions[f]
    show = " vs ".join(f"operand {k} [{','.join(a)}]{'?' if o else ''}" for k, a, o, _ in ops)
    wanted = [a for _, a, _, _ in ops if a]
    longest = max(wanted, key=len, default=())
    if len(got) >= len(longest):
        return f"factor {names[f]} takes [{','.join(got)}], the longest list its operands agree on ({show})"
    if any(a[:len(b)] != b and b[:len(a)] != a for a in wanted for b in wanted):
        return (f"the operands shard factor {names[f]} differently ({show}): lists that are not prefixes of one "
                f"another propagate only their common prefix")
    lost = longest[len(got)]
    holders = [g for g in range(len(rule.sizes)) if g != f and lost in {str(r) for r in dec.factors[g]}]
    if holders:
        g = holders[0]
        pf = min((p for _, a, _, p in ops if a), default=0)
        pg = min((p for _, a, _, p in opinions[g] if lost in a), default=0)
        size_f = max((_tensor_size(rule, k) for k, a, _, _ in ops if lost in a), default=0)
        size_g = max((_tensor_size(rule, k) for k, a, _, _ in opinions[g] if lost in a), default=0)
        if pg < pf:
            why = f"its annotation has the stronger priority (p{pg} < p{pf})"
        elif rule.kinds[f].contracting and not rule.kinds[g].contracting:
            why = ("a factor of the result beats a contracting one, which only takes axes left over (Shardy's "
                   "fake conflict between contracting and non-contracting dims)")
        elif size_g != size_f:
            why = f"it comes from the larger tensor ({size_g:,} elements vs {size_f:,})"
        else:
            why = ("on a tie the more sharded factor, then the left operand, wins (an elementwise op)"
                   if rule.elementwise else
                   "on a tie the left operand's factor wins (not an elementwise op: how sharded does not count)")
        return f"axis {lost} went to factor {names[g]}, which also wants it: {why}"
    if strat == "basic":
        if any(not o and len(a) < len(longest) for _, a, o, _ in ops):
            return (f"strategy basic: a closed operand never gains an axis, so factor {names[f]} stays "
                    f"[{','.join(got)}] ({show})")
        return (f"strategy basic: axis {lost} is held by another factor on some tensor, so neither takes it "
                f"({show})")
    return (f"factor {names[f]} ({rule.kinds[f].name}) can only be sharded [{','.join(got)}] here: its kind or the "
            f"dims it shares with other factors limit it ({show})")


def _operand_reasons(i: int, src: Any, tgt: Any, op: Any, rule: Any, dec: Any, opinions: list,
                     strat: str, strict: Any = False) -> list[str]:
    names = _names(len(rule.sizes))
    out = []
    if src.partial_axes and set(src.partial_axes) - set(tgt.partial_axes):
        summed = sorted(set(src.partial_axes) - set(tgt.partial_axes))
        if strict == "cost":
            out.append(f"the pending sum over {summed} is made here: passed on, it would be paid on the larger "
                       f"result (at least a reduce_scatter of its block), which costs more than summing operand {i}")
        elif op.linear is None or (op.linear_args is not None and i not in op.linear_args):
            out.append(f"{op.name} is not linear in operand {i}: its pending sum over {summed} is made first")
        else:
            out.append(f"the pending sum over {summed} is made here: another operand (or the product) uses that axis, "
                       f"and a sum cannot stay pending there")
    for d, (a, b) in enumerate(zip(src.dim_refs, tgt.dim_refs)):
        if a == b:
            continue
        factors = rule.operands[i][d]
        fs = ", ".join(f"{names[f]}->[{','.join(str(r) for r in dec.factors[f])}]" for f in factors) or "none"
        why = "; ".join(_why_dim(f, rule, dec, opinions, strat) for f in factors if rule.sizes[f] > 1)
        out.append(f"dim {d} [{','.join(map(str, a))}] -> [{','.join(map(str, b))}]: its factors decided {fs}"
                   + (f"; {why}" if why else ""))
    return out


def explain_steps(fn: Any, args: tuple, kwargs: dict) -> tuple[list[_Step], Any, Any, str, Any]:
    """Run ``fn`` as eager code runs it and read back its recorded steps: per step, what was decided and moved.
    The moves shown are the steps' own, so the totals are the comm log's."""

    strat, model = current_strategy(), current_cost_model()
    leaves = _named_leaves(fn, args, kwargs)
    names: dict[int, str] = {}
    table: dict[int, Any] = {}
    for name, v in leaves:
        if isinstance(v, Tensor) and id(v) not in table:
            # a twin: the same blocks, none of the sums an earlier use made of them (what a first run does)
            tw = table[id(v)] = Tensor(v._data, v._spec, v._shape, v._dtype, v._sid)
            tw._node = v._node
            names[serial(tw)] = name
    with C.comm_log() as log, inlined():
        out = fn(*_replace_leaves(args, table), **_replace_leaves(kwargs, table))
    steps: list[_Step] = []
    k = 0
    for st in log.steps:
        if st.op == MOVE:
            title = f"{names.get(st.out, 'const')} summed once for later uses    (in {st.user})"
        else:
            k += 1
            names.setdefault(st.out, f"%{k}")
            argnames = ", ".join(names.get(u.value, "const") if u.value else repr(u.const) for u in st.uses)
            title = f"{names[st.out]} = {st.name}({argnames})"
            if st.user and st.user != st.name:  # a step of a public op (softmax's max), or a gradient's reduction
                title += f"    (in {st.user})"
        lines: list[_Line] = []
        evs: list = []
        for i, u in enumerate(st.uses):
            if u.value:
                lines.append(_Line("operand", f"operand {i} {_desc_use(u, names)}"))
        if st.op in (RELAYOUT, MOVE):
            u = st.uses[0]
            got = _events_cost(u.events, model)
            if u.reused:
                lines.append(_Line("note", f"already moved to {short(u.dst)} for an earlier use (the summed copy is "
                                           f"kept; no communication)"))
            elif got:
                lines.append(_Line("move", f"{short(u.src)} -> {short(u.dst)}: "
                                           + "; ".join(_ev_text(e, t) for e, t in got)))
                lines.append(_Line("why", "with_sharding asked for this layout (the planner picked the cheapest "
                                          "collectives under the cost model)" if st.op == RELAYOUT else
                                          f"{st.user} uses this pending sum more than once: it is made first, once"))
            evs += got
        elif st.op == PLACE:
            lines.append(_Line("note", "a host value placed on the mesh: each device keeps its block "
                                       "(no communication)"))
        elif st.prog is None:
            lines.append(_Line("note", "no operand is sharded: runs once, on the host"))
        elif not isinstance(st.prog, Program):  # per-device code, nb.lax collectives, shard_map's edges
            for u in st.uses:
                got = _events_cost(u.events, model)
                if got:
                    evs += got
                    lines.append(_Line("move", "; ".join(_ev_text(e, t) for e, t in got)))
                    lines.append(_Line("why", f"an explicit collective ({st.name}) inside nb.shard_map"))
        else:
            evs += _explain_program(st, lines, model, strat)
        if st.op != MOVE:
            lines.append(_Line("result", f"result {_type_of(st.out_shape, st.out_dtype)} {st.out_spec!r}   "
                                         f"{short(st.out_spec)}" if st.out_spec is not None else
                               f"result {_type_of(st.out_shape, st.out_dtype)} on the host"))
        if not evs:
            lines.append(_Line("note", "no communication"))
        steps.append(_Step(title, lines, evs))
    return steps, log, model, strat, out


def _explain_program(st: Any, lines: list, model: Any, strat: str) -> list:
    """The lines of a planned op: its factors, each operand's move and why, halos, the result's move."""
    prog = st.prog
    evs: list = []
    flines, rule, dec, opinions = _factor_lines(st, strat)
    lines += [_Line("factors", x) for x in flines]
    for i, (u, p) in enumerate(zip(st.uses, prog.preps)):
        if not u.value:
            continue
        own = st.uses[i].src
        if u.settled:
            lines.append(_Line("note", f"operand {i}: its pending sum was made by an earlier use; that summed copy "
                                       f"{short(own)} is reused (no communication)"))
        if p.kind == "sharded":
            if u.reused:
                lines.append(_Line("note", f"operand {i}: already moved to {short(p.target)} for an earlier use (the "
                                           f"summed copy is kept; no communication)"))
            elif u.events:
                got = _events_cost(u.events, model)
                evs += got
                lines.append(_Line("move", f"operand {i} {short(own)} -> {short(p.target)}: "
                                           + "; ".join(_ev_text(e, t) for e, t in got)))
                for r in _operand_reasons(i, own, p.target, st.op, rule, dec, opinions, strat, prog.decision[3]):
                    lines.append(_Line("why", r))
        if p.mask_axes:
            lines.append(_Line("note", f"operand {i} is added once per {list(p.mask_axes)} group (kept on the "
                                       f"first device of each, zeros elsewhere): the sum stays pending, "
                                       f"no communication"))
        if p.kind == "host":
            lines.append(_Line("note", f"operand {i} is a host value: placed as {short(p.target)} "
                                       f"(a local slice, no communication)"))
        if u.inside:
            got = _events_cost(u.inside, model)
            evs += got
            lines.append(_Line("move", f"operand {i}, inside the op: " + "; ".join(_ev_text(e, t) for e, t in got)))
            lines.append(_Line("why", "a window (convolution, pooling, slice) needs rows its neighbours "
                                      "hold: each device receives only that halo"))
    if st.post:
        got = _events_cost(st.post, model)
        evs += got
        lines.append(_Line("move", f"result {short(prog.kspec)} -> {short(prog.result)}: "
                                   + "; ".join(_ev_text(e, t) for e, t in got)))
        lines.append(_Line("why", f"{st.name} reduces a dim sharded over "
                                  f"{sorted(set(prog.kspec.partial_axes) - set(prog.result.partial_axes))}: "
                                  f"each device's partial {st.op.reduction} is combined across them at once"))
    return evs


def _desc_use(u: Any, names: dict[int, str]) -> str:
    name = names.get(u.value, "const")
    where = "host (unsharded: placed on the mesh with every dim open, a local slice)" if u.src is None else \
        f"{u.src!r}   {short(u.src)}"
    return f"{name}: {_type_of(u.shape, u.dtype)} {where}"


def _render(steps: list[_Step], log: Any, model: Any, strat: str, head: str, fmt: str) -> str:
    n = sum(len(s.events) for s in steps)
    total_b = sum(e.bytes for s in steps for e, _ in s.events)
    total_t = sum(t for s in steps for _, t in s.events)
    total = f"total: {n} collective{'s' if n != 1 else ''}, {total_b:,} B/device, est. {total_t * 1e6:.1f} us"
    legend = ("notation: [{\"dp\"}, {}] is Shardy's (one {} per dim, major to minor axes, ? = open: propagation may "
              "add axes); [dp|-] is the short form (| between dims, - replicated, Σ partial sums); "
              f"est. us from {model!r} (latency per ring step + bytes / bandwidth)")
    if fmt == "text":
        out = [head, f"strategy {strat}", legend, ""]
        for s in steps:
            out.append(s.title)
            for ln in s.lines:
                out.append(("    why: " if ln.kind == "why" else "  ") + ln.text)
        out += ["", total]
        if log.events:
            out += ["", "comm log of the run:", log.summary()]
        return "\n".join(out)
    if fmt == "markdown":
        out = [f"**{head}** (strategy `{strat}`)", "", _md(legend), ""]
        for s in steps:
            out.append(f"#### `{s.title}`")
            out.append("")
            for ln in s.lines:
                if ln.kind == "why":
                    out.append(f"  - why: {_md(ln.text)}")
                elif ln.kind == "note":
                    out.append(f"- {_md(ln.text)}")
                else:
                    out.append(f"- `{ln.text}`")
            out.append("")
        out.append(f"**{total}**")
        if log.events:
            out += ["", "```", log.summary(), "```"]
        return "\n".join(out)
    if fmt == "html":
        e = _html.escape
        out = [f"<div class=\"nabla-explain\"><p><b>{e(head)}</b> (strategy <code>{e(strat)}</code>)</p>",
               f"<p>{e(legend)}</p>"]
        for s in steps:
            out.append(f"<h4><code>{e(s.title)}</code></h4><ul>")
            for ln in s.lines:
                cls = f" class=\"{ln.kind}\""
                out.append(f"<li{cls}>{'<i>why:</i> ' if ln.kind == 'why' else ''}{e(ln.text)}</li>")
            out.append("</ul>")
        out.append(f"<p><b>{e(total)}</b></p>")
        if log.events:
            out.append(f"<pre>{e(log.summary())}</pre>")
        out.append("</div>")
        return "\n".join(out)
    raise ShardingError(f"explain: format must be 'text', 'markdown' or 'html', got {fmt!r}")


def _md(text: str) -> str:
    """Code spans around specs so markdown shows braces and pipes as written."""
    import re
    return re.sub(r"(?<![\w`])(\[[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*\]\??(?: Σ[\w,:()]+)?|\{[^{}]*\})", r"`\1`", text)


def explain(fn: Any, *args: Any, format: str = "text", show: bool = True, **kwargs: Any) -> str:
    """Run ``fn(*args, **kwargs)`` and tell, op by op, the operand and result shardings, the factor shardings
    propagation decided (under the strategy in force) and every collective with its reason and estimated cost
    (``nb.CostModel``). Prints the text (``show=False``: only returns it); ``format="markdown"`` or ``"html"``
    for docs. Returns the text."""
    if format not in ("text", "markdown", "html"):
        raise ShardingError(f"explain: format must be 'text', 'markdown' or 'html', got {format!r}")
    steps, log, model, strat, _ = explain_steps(fn, args, kwargs)
    name = getattr(fn, "__name__", type(fn).__name__)
    head = f"explain {name}: {len(steps)} op{'s' if len(steps) != 1 else ''}"
    text = _render(steps, log, model, strat, head, format)
    if show:
        print(text)
    return text
