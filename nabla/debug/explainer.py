"""``nb.explain``: op by op, the shardings propagation chose and every collective with its reason and cost, read
from the steps the executor recorded (nothing is propagated or planned again)."""

from __future__ import annotations

import html as _html
import inspect
from typing import Any, NamedTuple

import numpy as np

from .. import collectives as C
from ..cost import current as current_cost_model
from ..errors import ShardingError
from ..program import Program
from ..jit import inlined
from .. import propagation
from ..propagation import current_strategy
from ..rules.core import factor_names
from ..step import MOVE, PLACE, RELAYOUT
from ..value import serial
from ..tensor import Tensor
from ..trace import link, link_of
from .visualize import short


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


def _factor_lines(step: Any) -> tuple[list[str], Any, Any]:
    """The op's factors: each one's size, kind, what every operand says, and what propagation decided (read from
    the recorded program's decision: nothing is propagated or projected again)."""
    rule, dec, keep, _ = step.prog.decision
    names = factor_names(len(rule.sizes))
    lines = [f"rule {rule}" + (f"; pending sums kept over {sorted(keep)}" if keep else "")]
    for f, n in enumerate(rule.sizes):
        kind = rule.kinds[f]
        tag = kind.name + (", contracting" if kind.contracting else "")
        decided = ",".join(str(r) for r in dec.factors[f])
        says = " ".join(f"op{o.operand} [{','.join(o.axes)}]{'?' if o.is_open else ''}"
                        + (f"p{o.priority}" if o.priority else "") for o in dec.opinions[f])
        lines.append(f"factor {names[f]}={n} ({tag}): {says or 'no operand sharded'} -> [{decided}]")
    return lines, rule, dec


def _operand_reasons(i: int, src: Any, tgt: Any, op: Any, rule: Any, dec: Any, strict: Any = False) -> list[str]:
    names = factor_names(len(rule.sizes))
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
        why = "; ".join(propagation.why(rule, dec, f) for f in factors if rule.sizes[f] > 1)
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
            tw = table[id(v)] = link(Tensor(v._data, v._spec, v._shape, v._dtype, v._sid), link_of(v))
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
            evs += _explain_program(st, lines, model)
        if st.op != MOVE:
            lines.append(_Line("result", f"result {_type_of(st.out_shape, st.out_dtype)} {st.out_spec!r}   "
                                         f"{short(st.out_spec)}" if st.out_spec is not None else
                               f"result {_type_of(st.out_shape, st.out_dtype)} on the host"))
        if not evs:
            lines.append(_Line("note", "no communication"))
        steps.append(_Step(title, lines, evs))
    return steps, log, model, strat, out


def _explain_program(st: Any, lines: list, model: Any) -> list:
    """The lines of a planned op: its factors, each operand's move and why, halos, the result's move."""
    prog = st.prog
    evs: list = []
    flines, rule, dec = _factor_lines(st)
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
                for r in _operand_reasons(i, own, p.target, st.op, rule, dec, prog.decision.strict):
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
